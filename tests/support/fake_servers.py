"""Fake vLLM P/D instances served over real HTTP, in a process of their own.

``python -m tests.support.fake_servers [N]`` serves N/2 prefill and N/2 decode instances (N is
4 unless given; the decode ones with the kvtether control routes on the same ports) sharing one
:class:`~tests.support.fake_vllm.Cluster`, each on a loopback port it binds itself, and prints
``ready PORT...`` (prefill ports first) once all of them listen. The load driver uses it so
that the fakes' CPU time is not spent on the router's event loop.
"""

from __future__ import annotations

import asyncio
import sys

import uvicorn

from .fake_vllm import Cluster, FakeVLLM
from .servers import HOST, bind_loopback, port_of
from .waiting import await_for


async def main(n: int) -> None:
    cluster = Cluster()
    socks = [bind_loopback() for _ in range(n)]
    servers = []
    for i, sock in enumerate(socks):
        role = "prefill" if i < n // 2 else "decode"
        port = port_of(sock)
        inst = FakeVLLM(cluster, f"{role}{i}", HOST, port, control=role == "decode",
                        side_channel_port=5600 + i)
        cluster.add(inst, f"{HOST}:{port}")
        config = uvicorn.Config(inst.app, log_level="warning", timeout_keep_alive=30)
        servers.append(uvicorn.Server(config))
    tasks = [asyncio.create_task(s.serve(sockets=[sock])) for s, sock in zip(servers, socks)]
    await await_for(lambda: all(s.started for s in servers) or any(t.done() for t in tasks),
                    timeout_s=60, interval_s=0.05, message="the fake servers to start")
    if all(s.started for s in servers):
        print("ready", *map(port_of, socks), flush=True)
    await asyncio.gather(*tasks)


if __name__ == "__main__":
    asyncio.run(main(int(sys.argv[1]) if len(sys.argv) > 1 else 4))
