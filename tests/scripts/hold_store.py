"""A worker that holds its job open until OUT_DIR/stop exists (90 s at most), for tests/test_store_exposure.py.
With ``init``: it first joins the process group (gradsync.init), and rank 0 writes where its store is
(MASTER_ADDR, MASTER_PORT) to OUT_DIR/master.json."""

import json
import os
import sys
import time
from pathlib import Path

out = Path(sys.argv[1])
if sys.argv[2:] == ["init"]:
    import gradsync

    info = gradsync.init()
    if info.rank == 0:
        where = {"addr": os.environ["MASTER_ADDR"], "port": int(os.environ["MASTER_PORT"])}
        (out / "master.json").write_text(json.dumps(where))
deadline = time.monotonic() + 90
while not (out / "stop").exists() and time.monotonic() < deadline:
    time.sleep(0.1)
