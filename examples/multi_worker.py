"""Two-worker training on one machine with MultiWorkerMirroredStrategy (TF_CONFIG).

    python examples/multi_worker.py

On several machines, run on each one
    TF_CONFIG='{"cluster": {"worker": ["host1:12345", "host2:12345"]},
                "task": {"type": "worker", "index": I}}' keras-vit train --strategy multiworker ...
with I = 0 on the chief. --batch-size is the global batch. The chief writes the output
folder; worker I writes its copy of the model under OUTPUT/worker-worker-I/.
"""

import json
import os
import socket
import subprocess
import sys


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


if __name__ == "__main__":
    workers = [f"127.0.0.1:{free_port()}" for _ in range(2)]
    command = [sys.executable, "-m", "keras_vit", "train", "--strategy", "multiworker"]
    command += ["--output", "runs/multi-worker", "--epochs", "5"]
    processes = []
    for index in range(2):
        config = {"cluster": {"worker": workers}, "task": {"type": "worker", "index": index}}
        env = dict(os.environ, TF_CONFIG=json.dumps(config))
        processes.append(subprocess.Popen(command, env=env))
    sys.exit(max(p.wait() for p in processes))
