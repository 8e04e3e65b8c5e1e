"""The memory lab: peak host memory of gradsync's DDP against torch's (``python -m bench.memory``)."""
