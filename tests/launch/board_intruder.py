"""A third process that reaches node 0's job board (a plain ``TCPStore`` client, as anyone on the network can be).

    python board_intruder.py PORT      # then one JSON list a line on stdin; it answers "ok" a line on stdout

    ["set", KEY, TEXT]          post TEXT as is (unsigned)
    ["sign-wrong", KEY, TEXT]   post the JSON TEXT sealed with a key of its own
    ["copy", SRC, DST]          post what is on SRC (a genuine message) again on DST
    ["add", KEY, N]             add N to a counter
"""

import json
import secrets
import sys
from datetime import timedelta

from torch.distributed import TCPStore

from align_pipeline.launch.board_auth import Channel


def main() -> None:
    store = TCPStore("127.0.0.1", int(sys.argv[1]), is_master=False, timeout=timedelta(seconds=30), use_libuv=True)
    print("ok", flush=True)
    for line in sys.stdin:
        action, *args = json.loads(line)
        if action == "set":
            store.set(args[0], args[1])
        elif action == "sign-wrong":
            store.set(args[0], Channel(secrets.token_bytes(32), "intruder").seal(args[0], json.loads(args[1])))
        elif action == "copy":
            store.set(args[1], store.get(args[0]))
        elif action == "add":
            store.add(args[0], int(args[1]))
        else:
            raise SystemExit(f"unknown action {action}")
        print("ok", flush=True)


if __name__ == "__main__":
    main()
