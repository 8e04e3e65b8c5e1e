"""gradsync from the trainers people already use: PyTorch Lightning (Trainer and Fabric) and Hugging Face
Accelerate. Each module imports its trainer only when used; install with ``gradsync[lightning]`` or
``gradsync[accelerate]``."""
