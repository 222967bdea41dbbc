"""The control plane's hot helpers keep their behaviour: batched prompt draws, encoding and decoding at the
tokenizer's backend, the registry's rotation and its acquire order, the Generate latency histogram and its
quantiles."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from relayrl.bench.controller import histogram_quantile
from relayrl.client.workers import WorkerRegistry
from relayrl.config import DataConfig, RewardConfig
from relayrl.controller.latency import LatencyHistogram
from relayrl.controller.scoring import Scorer
from relayrl.data.dataset import PromptDataset, render_prompt
from relayrl.data.fast_tokens import backend_encodes, encode_texts
from relayrl.v1 import common_pb2


def test_batched_draws_equal_single_draws_across_an_epoch(tiny_model_dir, digits_path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    dataset = PromptDataset(DataConfig(path=str(digits_path)), tokenizer, seed=3)
    start = len(dataset) - 5  # the batch crosses into the next epoch's shuffled order
    batch = dataset.records(start, 10)
    assert batch == [dataset.record(d) for d in range(start, start + 10)]
    assert [r.prompt_id.split(":")[0] for r in batch] == ["0"] * 5 + ["1"] * 5
    for record in batch:
        row = dataset.rows[int(record.prompt_id.split(":")[1])]
        assert (record.text, record.answer) == (row["prompt"], row["answer"])
        assert record.token_ids == render_prompt(tokenizer, row["prompt"], "auto")


def test_decode_all_is_the_tokenizers_decode(tiny_model_dir) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    scorer = Scorer(RewardConfig(fn="prefix_match"), tokenizer, max_tokens=8, row_of=lambda prompt_id: {})
    sequences = [[4, 5, tokenizer.eos_token_id], [tokenizer.pad_token_id, 7, 2], []]
    completions = [common_pb2.Completion(token_ids=ids) for ids in sequences]
    assert scorer.decode_all(completions) == [tokenizer.decode(ids, skip_special_tokens=True) for ids in sequences]
    tokenizer.clean_up_tokenization_spaces = True  # a clean-up pass: decoded by transformers itself
    slow = Scorer(RewardConfig(fn="prefix_match"), tokenizer, max_tokens=8, row_of=lambda prompt_id: {})
    assert slow.decode_all(completions) == [tokenizer.decode(ids, skip_special_tokens=True) for ids in sequences]


TEXTS = ["7 + 1 =", "", "  two  spaces", "a<|endoftext|>b", "ünïcödé 9"]


def test_encode_texts_is_the_tokenizers_call(tiny_model_dir) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    expected = tokenizer(TEXTS, add_special_tokens=True)["input_ids"]
    assert backend_encodes(tokenizer)
    assert encode_texts(tokenizer, TEXTS) == expected
    assert encode_texts(tokenizer, []) == []
    tokenizer.split_special_tokens = True  # "<|endoftext|>" as text: transformers switches the backend, so do we
    assert not backend_encodes(tokenizer)
    split = encode_texts(tokenizer, TEXTS)
    assert split == tokenizer(TEXTS, add_special_tokens=True)["input_ids"] and split[3] != expected[3]
    tokenizer.split_special_tokens = False
    tokenizer(TEXTS, add_special_tokens=True)  # puts the backend back
    tokenizer.backend_tokenizer.enable_truncation(max_length=2)  # a backend set to truncate: transformers' way
    assert not backend_encodes(tokenizer)
    assert encode_texts(tokenizer, TEXTS) == expected


def test_rotation_visits_every_worker_in_turn() -> None:
    registry = WorkerRegistry(timeout_s=30)
    for i in range(5):
        registry.register(f"w{i}", f"127.0.0.1:{1000 + i}", "hf", 0)
    assert len(registry) == 5
    rounds = [[w.worker_id for w in registry.rotation(2)] for _ in range(3)]
    assert rounds == [["w0", "w1"], ["w2", "w3"], ["w4", "w0"]]
    assert [w.worker_id for w in registry.rotation(8)] == [f"w{i}" for i in range(5)]  # a small fleet: all


def test_latency_histogram_and_its_quantiles() -> None:
    histogram = LatencyHistogram(buckets=(0.1, 0.2, 0.4))
    for seconds in (0.05, 0.15, 0.15, 0.3, 9.0):
        histogram.observe(seconds)
    buckets, count, total = histogram.snapshot()
    assert buckets == [(0.1, 1), (0.2, 3), (0.4, 4)] and count == 5 and total == pytest.approx(9.65)
    cumulative = [*buckets, (float("inf"), count)]
    assert histogram_quantile(0.5, cumulative) == pytest.approx(0.1 + 0.1 * (2.5 - 1) / 2)  # inside (0.1, 0.2]
    assert histogram_quantile(0.99, cumulative) == 0.4  # in +Inf: the last finite bound
    assert histogram_quantile(0.5, [(0.1, 0), (float("inf"), 0)]) == 0.0


class _Aborted(Exception):
    pass


class _Context:
    """The part of grpc.ServicerContext a unary handler's errors go through."""

    def abort(self, code, details):
        raise _Aborted(code, details)


def test_registration_limit_counts_new_workers_only(make_config, tmp_path) -> None:
    from relayrl.config import load_config
    from relayrl.controller.core import Controller
    from relayrl.services.controller_server import ControllerServicer
    from relayrl.v1 import controller_pb2

    controller = Controller(load_config(make_config(controller={"max_workers": 2})), state_dir=tmp_path / "state")
    servicer = ControllerServicer(controller)
    try:
        for worker_id in ("w0", "w1", "w0"):  # the second w0 is a heartbeat of a known worker
            request = controller_pb2.RegisterWorkerRequest(worker_id=worker_id, address="127.0.0.1:1")
            servicer.RegisterWorker(request, _Context())
        newcomer = controller_pb2.RegisterWorkerRequest(worker_id="w2", address="127.0.0.1:1")
        with pytest.raises(_Aborted) as refused:
            servicer.RegisterWorker(newcomer, _Context())
        assert refused.value.args[0].name == "RESOURCE_EXHAUSTED" and "workers" in refused.value.args[1]
        assert sorted(w.worker_id for w in controller.registry.snapshot()) == ["w0", "w1"]
    finally:
        controller.ledger.close()  # never started: no threads to stop


def test_heartbeat_interval_spreads_a_large_fleet_and_stays_under_the_timeout(make_config, tmp_path) -> None:
    from relayrl.config import load_config
    from relayrl.controller.core import Controller
    from relayrl.services.controller_server import ControllerServicer
    from relayrl.v1 import controller_pb2

    registry = WorkerRegistry(timeout_s=30)
    assert registry.heartbeat_interval_s(200) == 1.0  # empty or small: every second
    for i in range(1000):
        registry.register(f"w{i}", "127.0.0.1:1", "hf", 0)
    assert registry.heartbeat_interval_s(200) == 5.0  # 1,000 workers at 200 beats/s
    assert registry.heartbeat_interval_s(10) == 10.0  # capped at timeout / 3: two beats may be missed

    cfg = load_config(make_config(controller={"heartbeats_per_s": 2.0, "worker_timeout_s": 60}))
    controller = Controller(cfg, state_dir=tmp_path / "state")
    try:
        answers = [
            ControllerServicer(controller).RegisterWorker(
                controller_pb2.RegisterWorkerRequest(worker_id=f"w{i}", address="127.0.0.1:1"), _Context()
            )
            for i in range(6)
        ]
        assert [a.heartbeat_interval_s for a in answers] == [1.0, 1.0, 1.5, 2.0, 2.5, 3.0]  # workers / 2 per s
    finally:
        controller.ledger.close()


def test_a_heartbeat_that_changes_nothing_wakes_no_waiter() -> None:
    import threading

    registry = WorkerRegistry(timeout_s=30)
    registry.register("w0", "127.0.0.1:1", "hf", 0)
    woken = threading.Event()

    def wait() -> None:
        with registry.lock:
            if registry.lock.wait(timeout=30):
                woken.set()

    waiter = threading.Thread(target=wait)
    waiter.start()
    try:
        for _ in range(3):
            registry.register("w0", "127.0.0.1:1", "hf", 0)  # a plain heartbeat
        assert not woken.wait(0.5)
        registry.register("w0", "127.0.0.1:1", "hf", 1)  # a new version is news
        assert woken.wait(30)
    finally:
        waiter.join()


def test_fan_out_reports_a_worker_removed_meanwhile() -> None:
    from relayrl.controller.fanout import fan_out
    from relayrl.v1 import rollout_pb2

    registry = WorkerRegistry(timeout_s=30)
    registry.register("gone", "127.0.0.1:1", "hf", 0)
    listed = registry.snapshot()
    registry.remove("gone")  # closes its channel, as the reaper does
    responses, errors = fan_out(listed, "Stats", rollout_pb2.StatsRequest(), timeout_s=1)
    assert responses == {} and errors["gone"].startswith("UNAVAILABLE: worker removed")


def test_a_chunk_for_a_worker_removed_after_it_was_acquired_comes_back_for_retry() -> None:
    from relayrl.controller.dispatch import Attempt, Dispatcher, GroupClaims, PromptJob
    from relayrl.wire.sampling import SamplingParams

    registry = WorkerRegistry(timeout_s=30)
    registry.register("gone", "127.0.0.1:1", "hf", 0)
    worker = registry.acquire(min_version=0)
    registry.remove("gone")  # the reaper, between acquire and the call
    dispatcher = Dispatcher(registry, chunk_size=1, generate_timeout_s=5)
    params = SamplingParams(n=2, temperature=1.0, top_p=1.0, max_tokens=2)
    attempt = Attempt([PromptJob("p0", [4, 5])], worker)
    groups, error, aborted = dispatcher._generate_chunk(attempt, params, 0, GroupClaims(None))
    assert groups == {} and aborted == 0 and error.startswith("UNAVAILABLE: worker removed")  # run() re-dispatches


def _expected_acquire(registry: WorkerRegistry, min_version: int, only=None, idle_other_than=None):
    """acquire's contract, by brute force: the candidate with the least (in flight, last call); never-called workers
    (last call 0) tie in registration order."""
    candidates = [
        w
        for w in registry.snapshot()
        if w.state == "ready"
        and w.policy_version >= min_version
        and w.in_flight < registry.max_in_flight
        and (only is None or w.worker_id in only)
        and (idle_other_than is None or (w.in_flight == 0 and w.worker_id != idle_other_than.worker_id))
    ]
    return min(candidates, key=lambda w: (w.in_flight, w.last_dispatch), default=None)


def test_acquire_takes_the_least_loaded_then_least_recently_called_worker() -> None:
    registry = WorkerRegistry(timeout_s=30, max_in_flight=2)
    for i in range(3):
        registry.register(f"w{i}", f"127.0.0.1:{i + 1}", "hf", 0)
    assert [registry.acquire(0).worker_id for _ in range(4)] == ["w0", "w1", "w2", "w0"]  # then w0's second slot
    registry.release(registry.get("w1"))
    assert registry.acquire(0).worker_id == "w1"  # idle beats loaded
    registry.register("w3", "127.0.0.1:9", "hf", 0)
    assert registry.acquire(0).worker_id == "w3"  # never called: first
    registry.release(registry.get("w2"))
    registry.release(registry.get("w1"))
    assert registry.acquire(0).worker_id == "w2"  # both idle: w2 was called before w1's second call
    registry.set_state("w1", "draining")
    assert registry.acquire(0).worker_id == "w3"  # w1 is draining, w3 and w2 hold one call each, w3 called first
    assert registry.acquire(0).worker_id == "w2"
    assert registry.acquire(0) is None  # every ready worker is full
    assert registry.acquire(0, idle_other_than=registry.get("w0")) is None


def test_acquire_agrees_with_its_contract_over_random_fleet_events() -> None:
    import random

    rng = random.Random(7)
    registry = WorkerRegistry(timeout_s=30, max_in_flight=2)
    ids = [f"w{i}" for i in range(12)]
    held: list = []
    for step in range(3000):
        event = rng.random()
        worker_id = rng.choice(ids)
        if event < 0.1:
            registry.register(worker_id, f"127.0.0.1:{ids.index(worker_id) + 1}", "hf", rng.randrange(3))
        elif event < 0.13:
            registry.remove(worker_id)
        elif event < 0.16:
            registry.set_state(worker_id, rng.choice(["ready", "draining"]))
        elif event < 0.4 and held:
            registry.release(held.pop(rng.randrange(len(held))))
        else:
            min_version = rng.randrange(3)
            only = frozenset(rng.sample(ids, 6)) if rng.random() < 0.3 else None
            other = rng.choice(held) if held and rng.random() < 0.2 else None
            keys = {w.worker_id: (w.in_flight, w.last_dispatch) for w in registry.snapshot()}
            expected = _expected_acquire(registry, min_version, only, other)
            got = registry.acquire(min_version, only=only, idle_other_than=other)
            assert (got is None) == (expected is None), step
            if got is not None:
                assert keys[got.worker_id] == keys[expected.worker_id], step  # equal keys: equally right
                assert got is expected or expected.last_dispatch > 0, step  # never-called ones in join order
                held.append(got)


@pytest.mark.parametrize("index", [0, 5])
def test_group_samples_carry_every_field_of_the_group_and_its_completions(index: int) -> None:
    from relayrl.controller.core import Controller
    from relayrl.controller.scoring import ScoredGroup
    from relayrl.data.dataset import PromptRecord
    from relayrl.v1 import controller_pb2

    record = PromptRecord("0:17", "what?", [11, 12, 13], "4")
    completions = [
        common_pb2.Completion(
            prompt_id="0:17",
            sample_index=i,
            token_ids=[20 + i, 2],
            logprobs=[-0.25 * i, -1.0],
            finish_reason=common_pb2.FINISH_REASON_STOP,
            policy_version=3 + i,
            worker_id=f"w{i}",
        )
        for i in range(3)
    ]
    group = ScoredGroup(record, completions, scores=[1.0, 0.0, 1.0], rewards=[0.5, -0.5, 1.0])
    expected = [
        controller_pb2.Sample(
            prompt_id="0:17",
            group=index,
            prompt_token_ids=[11, 12, 13],
            response_token_ids=c.token_ids,
            rollout_logprobs=c.logprobs,
            reward=r,
            score=s,
            finish_reason=c.finish_reason,
            policy_version=c.policy_version,
            worker_id=c.worker_id,
        )
        for c, r, s in zip(completions, group.rewards, group.scores)
    ]
    samples = Controller._group_samples(index, group)
    assert samples == expected
    assert [s.SerializeToString(deterministic=True) for s in samples] == [
        s.SerializeToString(deterministic=True) for s in expected
    ]


def test_draws_of_later_epochs_come_from_the_rendered_rows_and_equal_a_fresh_render(
    tiny_model_dir, digits_path, monkeypatch
) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    cfg = DataConfig(path=str(digits_path))
    cached = PromptDataset(cfg, tokenizer, seed=3)
    rows = len(cached)
    first_epoch = cached.records(0, rows)
    assert len(cached._rendered) == rows

    class Unreadable(list):  # a later epoch neither reads the rows nor calls the tokenizer
        def __getitem__(self, key):
            raise AssertionError(f"rows[{key}] read again")

    monkeypatch.setattr(cached, "rows", Unreadable(range(rows)))
    monkeypatch.setattr(cached, "tokenizer", None)
    later = cached.records(2 * rows + 3, 7)
    fresh = PromptDataset(cfg, tokenizer, seed=3)
    assert later == fresh.records(2 * rows + 3, 7)
    later[0].token_ids.append(-1)  # a caller's list is its own
    assert cached.records(2 * rows + 3, 1) == fresh.records(2 * rows + 3, 1)
    assert {r.prompt_id.split(":")[1] for r in first_epoch} == {str(i) for i in range(rows)}


def test_rows_beyond_the_cache_bound_are_rendered_at_each_draw(tiny_model_dir, digits_path, monkeypatch) -> None:
    monkeypatch.setattr("relayrl.data.dataset.RENDERED_CACHE_TOKENS", 10)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    dataset = PromptDataset(DataConfig(path=str(digits_path)), tokenizer, seed=0)
    records = dataset.records(0, 20)
    assert 0 < len(dataset._rendered) < 20 and dataset._rendered_tokens >= 10
    assert dataset.records(0, 20) == records == [dataset.record(d) for d in range(20)]
