"""The start of a child that grpo/common/child.py's Child(clean=True) makes by exec: a new Python that holds
nothing of its parent's. Its first message on the pipe names the setup to serve and its arguments; then it
serves as a forked child does (grpo.common.child._serve: a keeper, a server, the session ended as one).

    python -m grpo.common.child_boot <pipe fd> <parent pid>
"""

from __future__ import annotations

import functools
import importlib
import json
import sys
from multiprocessing.connection import Connection

from grpo.common.child import _serve


def main(argv: list[str]) -> None:
    conn, parent = Connection(int(argv[0])), int(argv[1])
    spec = json.loads(conn.recv_bytes())
    module, _, name = spec["setup"].partition(":")
    setup = functools.partial(getattr(importlib.import_module(module), name), *spec["arguments"])
    sys.argv = [spec["name"]]
    _serve(conn, None, setup, spec["environment"], parent=parent)


if __name__ == "__main__":
    main(sys.argv[1:])
