"""Fake vLLM P/D instances served over real HTTP, in a process of their own.

``python -m tests.router.fake_servers PORT0 PORT1 PORT2 PORT3`` serves two prefill instances and
two decode instances (with the kvtether control routes on the same ports) sharing one
:class:`~tests.router.fake_vllm.Cluster`, and prints ``ready`` once all four listen. The load
benchmark uses it so that the fakes' CPU time is not spent on the router's event loop.
"""

from __future__ import annotations

import asyncio
import sys

import uvicorn

from .fake_vllm import Cluster, FakeVLLM


async def main(ports: list[int]) -> None:
    cluster = Cluster()
    servers = []
    for i, port in enumerate(ports):
        role = "prefill" if i < len(ports) // 2 else "decode"
        inst = FakeVLLM(cluster, f"{role}{i}", "127.0.0.1", port, control=role == "decode",
                        side_channel_port=5600 + i)
        cluster.add(inst, f"127.0.0.1:{port}")
        config = uvicorn.Config(inst.app, host="127.0.0.1", port=port, log_level="warning",
                                timeout_keep_alive=30)
        servers.append(uvicorn.Server(config))
    tasks = [asyncio.create_task(s.serve()) for s in servers]
    while not all(s.started for s in servers):
        await asyncio.sleep(0.05)
    print("ready", flush=True)
    await asyncio.gather(*tasks)


if __name__ == "__main__":
    asyncio.run(main([int(x) for x in sys.argv[1:]]))
