import os

import torch

# One thread per process: the ranks of a test share this machine's two cores.
torch.set_num_threads(1)
os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
