"""The convergence lab: methods that send less (compression, DiLoCo, Streaming DiLoCo), judged by the time to reach
torch's loss on a shaped link. ``python -m bench.converge`` (__main__.py) runs the methods; worker.py is one rank."""
