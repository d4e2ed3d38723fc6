"""The engine <-> frontend channel without Ray: its messages and the engine-side outboxes.

The outboxes are driven by a stand-in engine whose replica threads put deltas; a pull
must hand over every delta of that frontend's requests at once, in the order they were
produced, and a frontend that goes away must have its requests aborted."""

from __future__ import annotations

import asyncio
import threading

import pytest

from cluster.core.stream import RequestStream, deliver
from cluster.errors import EngineDeadError, EngineOverloadedError
from cluster.outputs import RequestMetrics, RequestOutput, StreamDelta, TokenLogprob
from cluster.remote import messages as channel
from cluster.remote.outbox import Outboxes
from scheduler.request import SamplingParams


class FakeEngine:
    """Accepts requests (refusing ones whose prompt says so) and records aborts."""

    def __init__(self):
        self.sinks: dict[str, object] = {}
        self.params: dict[str, SamplingParams | None] = {}
        self.aborted: list[str] = []
        self.groups: dict[str, str | None] = {}

    def add_request(self, prompt, params, request_id, sink=None, group=None):
        if prompt == "bad":
            raise ValueError("prompt must not be bad, got 'bad'")
        if prompt == "full":
            raise EngineOverloadedError("too many waiting requests; retry later")
        self.sinks[request_id] = sink
        self.params[request_id] = params
        self.groups[request_id] = group
        return sink

    def abort(self, request_id):
        self.aborted.append(request_id)
        sink = self.sinks.pop(request_id, None)
        if sink is not None:
            sink.put(StreamDelta(request_id, "", [], None, "abort", _output(request_id, "abort")))
        return sink is not None


def _output(rid: str, reason: str, text: str = "", ids=()) -> RequestOutput:
    return RequestOutput(rid, None, [1, 2], text, list(ids), reason, stop_reason=None,
                         metrics=RequestMetrics(arrival_time=1.0, ttft=0.5, num_preemptions=2))


def test_a_finished_delta_round_trips_with_its_output_and_logprobs():
    lps = [TokenLogprob(7, "a", -0.1, [(7, "a", -0.1), (9, "b", -2.5)])]
    out = _output("r", "length", "hi", [7, 8])
    entry = channel.unpack(channel.pack([channel.delta_entry(StreamDelta("r", "hi", [7, 8], lps, "length", out))]))
    rid, text, ids, reason, raw_lps, final = entry[0]
    got_lps = channel.entry_logprobs(raw_lps)
    got = channel.entry_output(rid, "the prompt", reason, final, got_lps)
    assert (rid, text, ids, reason) == ("r", "hi", [7, 8], "length")
    assert got_lps == lps
    assert got.prompt == "the prompt" and got.prompt_token_ids == [1, 2] and got.token_ids == [7, 8]
    assert got.metrics == out.metrics and got.finish_reason == "length" and got.logprobs == lps


def test_params_cross_as_plain_fields_and_are_validated_again():
    sp = SamplingParams(max_tokens=5, stop=["x", "y"], stop_token_ids=[3], logprobs=2, seed=4)
    op = channel.unpack(channel.pack([channel.submit_op("r", [1, 2, 3], sp, "parent")]))[0]
    assert channel.params_from(op[3]) == sp and op[4] == "parent"
    with pytest.raises(ValueError, match="top_p"):
        channel.params_from({**op[3], "top_p": 5.0})
    with pytest.raises(ValueError, match="nonsense"):
        channel.params_from({"nonsense": 1})


@pytest.mark.parametrize("error,kind", [(ValueError("bad prompt"), ValueError),
                                        (EngineOverloadedError("full"), EngineOverloadedError),
                                        (EngineDeadError("gone"), EngineDeadError),
                                        (KeyError("x"), RuntimeError)])
def test_refusals_are_raised_as_their_kind_on_the_frontend(error, kind):
    rid, k, message, retry_after = channel.refusal("r", error)
    got = channel.refusal_error(k, message, retry_after)
    assert type(got) is kind and rid == "r"


def test_one_pull_carries_every_delta_of_many_requests_in_order():
    async def main():
        engine = FakeEngine()
        boxes = Outboxes(engine)
        boxes.open("fe", lease_s=30)
        ops = [channel.submit_op(f"r{i}", f"p{i}", SamplingParams(max_tokens=3)) for i in range(50)]
        ops += [channel.submit_op("x", "bad", None), channel.submit_op("y", "full", None)]
        ops += [channel.submit_op("z", "p", None, group=7)]
        refused = channel.unpack(boxes.push("fe", channel.pack(ops)))
        assert [(r[0], r[1]) for r in refused] == [("x", "value"), ("y", "overloaded"), ("z", "value")]
        assert "group" in refused[2][2]
        assert channel.refusal_error(*refused[0][1:]).args[0] == "prompt must not be bad, got 'bad'"

        def replica(ids):  # a replica thread producing three steps of deltas
            for step in range(3):
                for i in ids:
                    sink = engine.sinks[f"r{i}"]
                    done = step == 2
                    sink.put(StreamDelta(f"r{i}", f"t{step}", [step], None, "length" if done else None,
                                         _output(f"r{i}", "length", "t0t1t2", [0, 1, 2]) if done else None))

        threads = [threading.Thread(target=replica, args=(range(k, 50, 2),)) for k in (0, 1)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        entries = channel.unpack(await boxes.pull("fe", 1.0))
        assert len(entries) == 150  # everything produced so far, in one message
        for i in range(50):
            mine = [e for e in entries if e[0] == f"r{i}"]
            assert [e[1] for e in mine] == ["t0", "t1", "t2"] and [e[3] for e in mine] == [None, None, "length"]
        assert channel.unpack(await boxes.pull("fe", 0.05)) == []  # nothing new: an empty heartbeat
        assert boxes.stats()["frontend_batches"] == 1 and boxes.stats()["frontend_deltas"] == 150
        assert boxes.close("fe") == 0 and engine.aborted == []

    asyncio.run(main())


def test_a_pull_waits_for_the_first_delta_then_takes_the_rest():
    async def main():
        engine = FakeEngine()
        boxes = Outboxes(engine)
        boxes.open("fe")
        boxes.push("fe", channel.pack([channel.submit_op("a", "p", None)]))
        pending = asyncio.ensure_future(boxes.pull("fe", 5.0))
        await asyncio.sleep(0.05)
        assert not pending.done()
        threading.Thread(target=engine.sinks["a"].put, args=(StreamDelta("a", "x", [1]),)).start()
        entries = channel.unpack(await pending)
        assert [(e[0], e[1]) for e in entries] == [("a", "x")]

    asyncio.run(main())


def test_aborts_ride_with_submissions_and_a_closed_frontend_aborts_its_requests():
    async def main():
        engine = FakeEngine()
        boxes = Outboxes(engine)
        boxes.open("fe")
        boxes.push("fe", channel.pack([channel.submit_op("a", "p", None), channel.submit_op("b", "p", None),
                                       channel.abort_op("a"), channel.submit_op("c", "p", None)]))
        assert engine.aborted == ["a"]
        entries = channel.unpack(await boxes.pull("fe", 1.0))
        assert [(e[0], e[3]) for e in entries] == [("a", "abort")]
        assert boxes.close("fe") == 2
        assert sorted(engine.aborted) == ["a", "b", "c"]
        with pytest.raises(ValueError, match="not connected"):
            await boxes.pull("fe", 0.1)

    asyncio.run(main())


def test_a_frontend_that_stops_pulling_is_dropped_after_its_lease():
    async def main():
        engine = FakeEngine()
        boxes = Outboxes(engine)
        boxes.open("gone", lease_s=0.2)
        boxes.open("alive", lease_s=0.2)
        boxes.push("gone", channel.pack([channel.submit_op("g1", "p", None), channel.submit_op("g2", "p", None)]))
        boxes.push("alive", channel.pack([channel.submit_op("a1", "p", None)]))
        for _ in range(20):  # "alive" keeps pulling, "gone" never does
            await boxes.pull("alive", 0.05)
            if boxes.stats()["frontends_expired"]:
                break
        assert sorted(engine.aborted) == ["g1", "g2"]
        assert boxes.stats()["frontends"] == 1

    asyncio.run(main())


def test_deliver_wakes_each_event_loop_once_for_many_streams():
    async def main():
        loop = asyncio.get_running_loop()
        streams = [RequestStream(f"r{i}", loop) for i in range(20)]
        calls = []
        real = loop.call_soon_threadsafe
        loop.call_soon_threadsafe = lambda *a: (calls.append(a), real(*a))[1]
        items = [(s, StreamDelta(s.request_id, "a", [1])) for s in streams]
        items += [(s, StreamDelta(s.request_id, "b", [2], None, "stop", _output(s.request_id, "stop", "ab")))
                  for s in streams]
        t = threading.Thread(target=deliver, args=(items,))
        t.start()
        t.join()
        outs = [await s.aresult() for s in streams]
        del loop.call_soon_threadsafe
        assert len(calls) == 1
        assert all(o.text == "ab" and o.finish_reason == "stop" for o in outs)
        failing = RequestStream("f", loop)
        deliver([(failing, EngineDeadError("lost the engine"))])
        with pytest.raises(EngineDeadError):
            await failing.aresult()

    asyncio.run(main())


def test_batches_hand_a_reader_everything_queued_in_order_and_end_after_the_last():
    async def main():
        loop = asyncio.get_running_loop()
        s = RequestStream("r", loop)
        got = []
        reader = asyncio.ensure_future(_collect(s.batches(), got))
        await asyncio.sleep(0)  # the reader waits for the first delta
        deliver([(s, StreamDelta("r", "a", [1]))])
        await asyncio.sleep(0.01)
        deliver([(s, StreamDelta("r", t, [i])) for i, t in enumerate("bcd", 2)]
                + [(s, StreamDelta("r", "e", [5], None, "stop", _output("r", "stop", "abcde")))])
        await asyncio.wait_for(reader, 5)
        assert [[d.text for d in b] for b in got] == [["a"], ["b", "c", "d", "e"]]
        assert s.ended and s.output.text == "abcde"
        failing = RequestStream("f", loop)
        threading.Thread(target=failing.fail, args=(EngineDeadError("lost the engine"),)).start()
        with pytest.raises(EngineDeadError):
            async for _ in failing.batches():
                pass
        with pytest.raises(TypeError):
            async for _ in RequestStream("sync").batches():
                pass

    asyncio.run(main())


async def _collect(batches, into: list) -> None:
    async for b in batches:
        into.append(b)


def test_a_grammar_crosses_as_plain_fields_and_comes_back_a_grammar_spec():
    from scheduler.grammar_spec import GrammarSpec

    sp = SamplingParams(max_tokens=5, grammar=GrammarSpec("json_schema", '{"type": "object"}'))
    op = channel.unpack(channel.pack([channel.submit_op("r", [1, 2, 3], sp)]))[0]
    assert channel.params_from(op[3]) == sp
    with pytest.raises(ValueError, match="grammar kind"):
        channel.params_from({**op[3], "grammar": {"kind": "xml", "text": ""}})
    with pytest.raises(ValueError, match="grammar must be a mapping"):
        channel.params_from({**op[3], "grammar": {"nonsense": 1}})


def test_a_slow_stats_call_never_stalls_the_frontend_channel():
    """/metrics, /health and worker stats run off the engine actor's event loop: while one
    blocks (here: worker stats waiting 1 s on a busy worker), pushes and pulls go on."""
    import time

    from cluster.remote.engine_actor import EngineActor

    class SlowStatsEngine(FakeEngine):
        def worker_stats(self):
            time.sleep(1.0)
            return [{"pid": 1}]

        def stats(self):
            return {"num_running": len(self.sinks)}

    async def main():
        actor = EngineActor.__new__(EngineActor)  # the actor's methods, without Ray or a model
        actor.engine, actor._ready = SlowStatsEngine(), True
        actor._outboxes = Outboxes(actor.engine)
        await actor.open_connection("fe", 30.0)
        slow = asyncio.ensure_future(actor.worker_stats())
        await asyncio.sleep(0.05)
        t0 = time.perf_counter()
        await actor.push("fe", channel.pack([channel.submit_op("a", "p", None)]))
        pending = asyncio.ensure_future(actor.pull("fe", 5.0))
        actor.engine.sinks["a"].put(StreamDelta("a", "x", [1]))
        entries = channel.unpack(await pending)
        assert (await actor.stats())["num_running"] == 1
        assert time.perf_counter() - t0 < 0.5 and not slow.done()  # served while worker stats waited
        assert [(e[0], e[1]) for e in entries] == [("a", "x")]
        assert await slow == [{"pid": 1}]

    asyncio.run(main())
