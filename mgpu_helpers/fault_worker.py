"""A torchrun worker that waits, for the faults lesson 07 stages (standard library only).

Run by ``torchrun`` as a script: ``fault_worker.py FOLDER MODE SECONDS``. Each worker writes
``rank<R>-attempt<A>.json`` (what torchrun told it, as lesson 07's whoami script does, its
process id and its parent's, the time).
On the first attempt it waits until every worker of the job has written its file, stays alive
for SECONDS more, so that something can be killed, and writes ``rank<R>-end.json`` with its
parent at that moment (1 or a subreaper once its agent is gone). A later attempt (after a
restart) exits at once. MODE ``kill-agent``: once all are up, local rank 0 writes
``agent-killed.json`` (the agent's process id, the time) and sends its own agent ``SIGKILL``.
MODE ``wait``: nothing more.
"""

import json
import os
import signal
import sys
import time

NAMES = (
    "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
    "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_RUN_ID",
)  # fmt: skip


def write(path: str, data: dict) -> None:
    with open(path + ".tmp", "w") as f:
        json.dump(data, f)
    os.replace(path + ".tmp", path)  # a reader never sees half a file


def main() -> None:
    folder, mode, seconds = sys.argv[1], sys.argv[2], float(sys.argv[3])
    if mode not in ("wait", "kill-agent"):
        sys.exit(f"fault_worker.py: MODE must be 'wait' or 'kill-agent', not {mode!r}")
    seen = {name: os.environ.get(name) for name in NAMES}
    seen.update(pid=os.getpid(), parent=os.getppid(), time=time.time())
    rank, attempt = seen["RANK"], seen["TORCHELASTIC_RESTART_COUNT"]
    write(os.path.join(folder, f"rank{rank}-attempt{attempt}.json"), seen)
    if attempt != "0":
        return
    world, waited = int(seen["WORLD_SIZE"] or 1), time.time() + 60
    while time.time() < waited:  # until every worker of the job is up (a minute at most)
        if sum(n.endswith("-attempt0.json") for n in os.listdir(folder)) >= world:
            break
        time.sleep(0.05)
    if mode == "kill-agent" and seen["LOCAL_RANK"] == "0":
        killed = {"agent": os.getppid(), "time": time.time()}
        write(os.path.join(folder, "agent-killed.json"), killed)
        os.kill(os.getppid(), signal.SIGKILL)
    time.sleep(seconds)
    end = {"parent": os.getppid(), "time": time.time()}
    write(os.path.join(folder, f"rank{rank}-end.json"), end)


if __name__ == "__main__":
    main()
