"""Two-worker training on one machine with MultiWorkerMirroredStrategy (TF_CONFIG).

    python examples/multi_worker.py [keras-vit train options, e.g. --epochs 1]

It writes runs/multi-worker; pass --output DIR to run it again (a folder that holds a
run is refused). If one worker stops with an error, the other, which would wait for it
forever, is stopped too.

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
import time


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_all(processes, poll_seconds=1.0):
    """The highest exit status of `processes`; the first failure kills the others."""
    status, running = 0, list(processes)
    while running:
        for process in list(running):
            code = process.poll()
            if code is None:
                continue
            running.remove(process)
            status = max(status, code)
            if code:  # the others would wait for this worker's collectives forever
                for other in running:
                    other.kill()
                    other.wait()
                running = []
                break
        time.sleep(poll_seconds if running else 0)
    return status


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    workers = [f"127.0.0.1:{free_port()}" for _ in range(2)]
    command = [sys.executable, "-m", "keras_vit", "train", "--strategy", "multiworker"]
    command += ["--output", "runs/multi-worker", "--epochs", "5", *argv]  # later flags win
    processes = []
    for index in range(2):
        config = {"cluster": {"worker": workers}, "task": {"type": "worker", "index": index}}
        env = dict(os.environ, TF_CONFIG=json.dumps(config))
        processes.append(subprocess.Popen(command, env=env))
    return wait_all(processes)


if __name__ == "__main__":
    sys.exit(main())
