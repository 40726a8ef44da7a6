"""``alignpipe`` on the PATH of a ``dvc`` the tests run (``stage_runner.dvc_env``): the stage
process DVC starts, forked from the test worker's preloaded stage runner instead of a new
interpreter that imports torch, transformers and TRL again (~6 s of CPU per stage).

DVC runs ``$SHELL -c "alignpipe run <stage>"``, which finds this script first. It connects to
the runner's Unix socket, hands over its argv, directory, environment (without this script's
folder on PATH and the runner's own variables) and its stdin, stdout and stderr (SCM_RIGHTS),
and waits: the forked run writes to DVC's own pipes, and its exit code (or the signal that
killed it) becomes this process's, so DVC sees what it would of a stage process. What DVC or a
test does to this process reaches the run: SIGINT, SIGTERM and SIGHUP are forwarded to its
process group, its parent's death turns into SIGTERM as for a stage process
(``alignpipe.launch.interrupt.stop_with_parent``), and if this process is killed outright the
runner sends the run SIGTERM.

Anything else, a runner that refuses the run (``fork_server.differs``: an import-time variable
not the runner's) or a runner that is gone, ``exec``s the real ``alignpipe``. Standard library
only: the script runs ``python -S``, in a few milliseconds.
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import socket
import sys

SOCKETS = "ALIGNPIPE_TEST_STAGE_SOCKETS"  # "lean=PATH,scientific=PATH" (stage_runner.dvc_env)
SCIENTIFIC = "ALIGNPIPE_TEST_SCIENTIFIC_STAGES"  # the stages the "scientific" runner serves
FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def write(folder: str, real: str, repo: str) -> str:
    """Write the ``alignpipe`` script into ``folder``; its path. ``real`` is the console script it
    stands in for, ``repo`` the checkout whose tests/ holds this module."""
    path = os.path.join(folder, "alignpipe")
    with open(path, "w") as f:
        f.write(
            f"#!{sys.executable} -S\n"
            "import sys\n"
            f"sys.path.insert(0, {repo!r})\n"
            "from tests.stage_shim import main\n"
            f"main({real!r}, {repo!r})\n"
        )
    os.chmod(path, 0o755)
    return path


def _stop_with_parent(repo: str) -> None:
    """alignpipe.launch.interrupt.stop_with_parent, loaded by path (this interpreter has no
    site-packages; the module is standard library only)."""
    path = os.path.join(repo, "alignpipe", "launch", "interrupt.py")
    spec = importlib.util.spec_from_file_location("_alignpipe_interrupt", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.stop_with_parent()


def main(real: str, repo: str) -> None:
    argv, env = sys.argv, dict(os.environ)
    here = os.path.dirname(os.path.abspath(argv[0]))
    env["PATH"] = os.pathsep.join(p for p in env.get("PATH", "").split(os.pathsep) if p != here)
    sockets = dict(item.split("=", 1) for item in env.pop(SOCKETS, "").split(",") if item)
    scientific = env.pop(SCIENTIFIC, "").split(",")
    if len(argv) < 3 or argv[1] != "run" or not sockets:
        os.execve(real, [real, *argv[1:]], env)
    flavour = "scientific" if argv[2].split("@")[0] in scientific else "lean"
    runner = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        runner.connect(sockets[flavour])
        request = {"argv": ["alignpipe", *argv[1:]], "cwd": os.getcwd(), "env": env}
        socket.send_fds(runner, [json.dumps(request).encode()], [0, 1, 2])
        answer = json.loads(runner.recv(1 << 16) or b"{}")
    except OSError:
        answer = {}
    if "pid" not in answer:  # refused (answer["fresh"] names why) or no runner
        runner.close()
        os.execve(real, [real, *argv[1:]], env)

    def forward(signum: int, _frame) -> None:
        runner.send(json.dumps({"signal": signum}).encode())

    for sig in FORWARDED:
        signal.signal(sig, forward)
    _stop_with_parent(repo)
    answer = json.loads(runner.recv(1 << 16) or b'{"returncode": 1}')
    code = answer["returncode"]
    if code < 0:  # killed by a signal: die of the same one, as the stage process did
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    sys.exit(code)
