"""EngineCalls: the asyncio methods an engine's hosting actor answers over its LocalEngine (`engine`),
shared by the named EngineActor (`raylm serve`) and the Ray Serve engine replica (EngineServer).

Each may block (a lock the replica loop holds, a worker's stats call that waits for its step), so
it runs on the executor: the actor's event loop keeps serving requests meanwhile."""

from __future__ import annotations

import asyncio


class EngineCalls:
    engine = None  # the LocalEngine, set by the actor

    def info(self) -> dict:
        """What a client needs of the engine (cluster/remote/client.py ClientEngine)."""
        e = self.engine
        return {"config": e.config.to_dict(), "model_path": e.model_path, "max_model_len": e.max_model_len,
                "vocab_size": e.vocab_size, "sampling_defaults": e.sampling_defaults}

    async def abort(self, request_id: str) -> bool:
        return await self._off_loop(self.engine.abort, request_id)

    async def stats(self) -> dict:
        return await self._off_loop(self.engine.stats)

    async def health(self) -> dict:
        return await self._off_loop(self.engine.health)

    async def worker_stats(self) -> list[dict]:
        return await self._off_loop(self.engine.worker_stats)

    async def metrics_text(self) -> bytes:
        return await self._off_loop(self.engine.metrics_text)

    async def apply_chat_template(self, messages, tools=None, template_kwargs=None) -> str:
        return await self._off_loop(self.engine.apply_chat_template, messages, tools, template_kwargs)

    @staticmethod
    async def _off_loop(fn, *args):
        return await asyncio.get_running_loop().run_in_executor(None, fn, *args)
