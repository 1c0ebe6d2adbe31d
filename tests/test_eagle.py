"""EAGLE heads: the rollout that replays chain drafting equals running the head on the extended sequence."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from specrt.export.eagle import HeadShape, head_arrays, make_head  # noqa: E402

SHAPE = HeadShape(hidden=32, heads=4, kv_heads=2, head_dim=8, intermediate=48, rope_theta=10000.0, rms_eps=1e-5)


def test_rollout_steps_equal_the_causal_pass_over_the_drafted_sequence():
    """Item m of a rollout step attends to the real positions 0..m and its own earlier steps: exactly the causal
    pass over [real inputs 0..m, rollout inputs], which is what the runtime's head with a KV cache computes."""
    torch.manual_seed(0)
    head = make_head(SHAPE).eval()
    T = 7
    feat, emb = torch.randn(1, T, 32), torch.randn(1, T, 32)
    pos = torch.arange(T)[None]
    with torch.no_grad():
        pred, real = head(feat, emb, pos)
        steps, own, x = [], [], pred
        for k in range(2):
            e = torch.randn(1, T, 32)  # the drafted tokens' embeddings
            x_next, kv = head.step(x, e, pos + k + 1, real, own)
            own.append(kv)
            steps.append((x, e, x_next))
            x = x_next
        for m in range(T):
            f_ext = torch.cat([feat[:, : m + 1], steps[0][0][:, m:m + 1], steps[1][0][:, m:m + 1]], 1)
            e_ext = torch.cat([emb[:, : m + 1], steps[0][1][:, m:m + 1], steps[1][1][:, m:m + 1]], 1)
            full, _ = head(f_ext, e_ext, torch.arange(m + 3)[None])
            np.testing.assert_allclose(full[0, m + 1].numpy(), steps[0][2][0, m].numpy(), rtol=1e-4, atol=1e-5)
            np.testing.assert_allclose(full[0, m + 2].numpy(), steps[1][2][0, m].numpy(), rtol=1e-4, atol=1e-5)


def test_a_fused_head_reads_a_drafted_position_as_zero_low_and_middle_features():
    """EAGLE-3's fusion: a drafted position has only a predicted feature, which the head reads as [0 ; 0 ; it];
    an untrained fusion passes the high (final-norm) third through, so it starts as EAGLE-1."""
    torch.manual_seed(0)
    head = make_head(SHAPE, fuse=True).eval()
    feat = torch.randn(1, 5, 3 * 32)
    np.testing.assert_allclose(head.real(feat).detach().numpy(), feat[..., 64:].numpy(), rtol=1e-6, atol=1e-6)
    with torch.no_grad():
        head.fuse.weight.normal_()
        head.fuse.bias.normal_()
        pred = torch.randn(1, 5, 32)
        padded = torch.cat([torch.zeros(1, 5, 64), pred], -1)
        np.testing.assert_allclose(head.drafted(pred).numpy(), head.real(padded).numpy(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("fuse", [False, True])
def test_the_training_time_test_loss_is_the_loss_of_the_chains_drafted_one_by_one(fuse):
    """chain_loss with ttt_steps=2: the mean of step 1's loss (teacher forced) and step 2's, where item m reads
    its own step-1 prediction and the true token after it; recomputed here from the causal pass over each item's
    drafted sequence [real inputs 0..m, (prediction, x_{m+2})], which is what the runtime's head computes."""
    from specrt.export.eagle import EagleTrainConfig
    from specrt.export.train.eagle import chain_loss

    torch.manual_seed(2)
    head = make_head(SHAPE, fuse=fuse).eval()
    if fuse:
        with torch.no_grad():
            head.fuse.weight.normal_(std=0.1)
    T, V = 9, 40
    tok = torch.randint(0, V, (1, T))
    feat = torch.randn(1, T, (3 if fuse else 1) * 32)
    mask = torch.ones(1, T, dtype=torch.bool)
    E, W = torch.randn(V, 32), torch.randn(V, 32)
    cfg = EagleTrainConfig(noise=0.0, ttt_steps=2, fuse=fuse)
    with torch.no_grad():
        reg, cls = chain_loss(head, tok, feat, mask, E, W, cfg, 1.0, 32)
        high = feat[..., -32:]
        pos = torch.arange(T - 1)[None]
        first, _ = head(feat[:, :-1], E[tok[:, 1:]], pos)
        preds2, targets2 = [], []
        for m in range(T - 2):  # items whose second step has a true feature to meet
            drafted = first[:, m:m + 1]
            as_input = torch.cat([torch.zeros(1, 1, 64), drafted], -1) if fuse else drafted
            inputs = torch.cat([feat[:, : m + 1], as_input], 1)
            out, _ = head(inputs, E[tok[:, 1: m + 3]], torch.arange(m + 2)[None])
            preds2.append(out[0, m + 1])
            targets2.append(high[0, m + 2])
        p2, t2 = torch.stack(preds2), torch.stack(targets2)
        p1, t1 = first[0], high[0, 1:]

        def losses(p, t):
            soft = torch.softmax(t @ W.T, -1)
            return (torch.nn.functional.smooth_l1_loss(p, t),
                    -(soft * torch.log_softmax(p @ W.T, -1)).sum(-1).mean())

        (r1, c1), (r2, c2) = losses(p1, t1), losses(p2, t2)
    np.testing.assert_allclose(float(reg), float(r1 + r2) / 2, rtol=1e-4)
    np.testing.assert_allclose(float(cls), float(c1 + c2) / 2, rtol=1e-4)


def test_a_fused_head_is_refused_before_any_build_work(tmp_path):
    from specrt.errors import SpecrtError
    from specrt.export.eagle import save_head
    from specrt.pipeline.eagle import check_head

    save_head(tmp_path / "fused.npz", make_head(SHAPE, fuse=True), np.arange(10),
              {"shape": SHAPE.__dict__, "config": {"fuse": True}})
    with pytest.raises(SpecrtError, match="EAGLE-3.*without fuse"):
        check_head(tmp_path / "fused.npz")
    (tmp_path / "junk.npz").write_text("not a head")
    with pytest.raises(SpecrtError, match="not an EAGLE head file"):
        check_head(tmp_path / "junk.npz")
    save_head(tmp_path / "plain.npz", make_head(SHAPE), np.arange(10), {"shape": SHAPE.__dict__})
    check_head(tmp_path / "plain.npz")


def test_the_onnx_head_equals_the_torch_head(tmp_path):
    """export_eagle_onnx's graph on ONNX Runtime's CPU provider: a prefill of real positions then one drafted step
    written after them in the cache, against the torch head's causal pass over the same inputs."""
    import onnxruntime as ort

    from specrt.export.eagle import export_eagle_onnx, save_head
    from specrt.interface import ATTENTION_MASK, EAGLE_FEATURES, INPUT_IDS, POSITION_IDS, WRITE_INDICES

    torch.manual_seed(1)
    head = make_head(SHAPE).eval()
    V, H = 50, 32
    rng = np.random.default_rng(0)
    embed, lm_head = rng.standard_normal((V, H)).astype(np.float32), rng.standard_normal((V, H)).astype(np.float32)
    vocab = np.arange(0, V, 2)
    save_head(tmp_path / "head.npz", head, vocab, {"shape": SHAPE.__dict__})
    head = make_head(SHAPE).eval()  # the float16-rounded weights the file holds
    head.load_state_dict({k: torch.from_numpy(v) for k, v in head_arrays(tmp_path / "head.npz")[0].items()})
    info = export_eagle_onnx(tmp_path / "head.npz", embed, lm_head, tmp_path / "eagle.onnx", max_context=32, topk=4)
    C = info["capacity"]
    sess = ort.InferenceSession(str(tmp_path / "eagle.onnx"), providers=["CPUExecutionProvider"])
    cache = {n: np.zeros((1, 2, C, 8), np.float32) for n in ("past_key_values.0.key", "past_key_values.0.value")}

    def run(feat, ids, start):
        W = len(ids)
        mask = np.full((1, 1, W, C), -np.inf, np.float32)
        for r in range(W):
            mask[0, 0, r, : start + r + 1] = 0
        feeds = {EAGLE_FEATURES: feat[None], INPUT_IDS: ids[None], POSITION_IDS: np.arange(start, start + W)[None],
                 ATTENTION_MASK: mask, WRITE_INDICES: np.array([start]), **cache}
        outs = sess.run(None, feeds)
        names = [o.name for o in sess.get_outputs()]
        got = dict(zip(names, outs))
        cache["past_key_values.0.key"], cache["past_key_values.0.value"] = got["present.0.key"], got["present.0.value"]
        return got

    feat, ids = rng.standard_normal((6, H)).astype(np.float32), rng.integers(0, V, 6)
    first = run(feat[:5], ids[:5], 0)
    second = run(feat[5:], ids[5:], 5)
    with torch.no_grad():
        E = torch.from_numpy(embed)
        ref, _ = head(torch.from_numpy(feat)[None], E[torch.from_numpy(ids)][None], torch.arange(6)[None])
        logp = torch.log_softmax(ref[0] @ torch.from_numpy(lm_head[vocab]).T, -1)
    hidden = np.concatenate([first["hidden_states"][0], second["hidden_states"][0]])
    np.testing.assert_allclose(hidden, ref[0].numpy(), rtol=2e-3, atol=2e-3)  # the token table is float16
    tokens = np.concatenate([first["draft_tokens"][0], second["draft_tokens"][0]])
    np.testing.assert_array_equal(tokens[:, 0], vocab[logp.argmax(-1).numpy()])
    np.testing.assert_allclose(np.concatenate([first["draft_logprobs"][0], second["draft_logprobs"][0]])[:, 0],
                               logp.max(-1).values.numpy(), rtol=1e-2, atol=1e-2)


# --- the engine set and the proposer --------------------------------------------------------------------------

@pytest.fixture(scope="module")
def eagle_engines(tiny_dir, tiny_engines, tmp_path_factory):
    """The tiny Llama's set with a random EAGLE head, built through the pipeline (`--eagle-head`)."""
    from transformers import AutoConfig

    from specrt.export.eagle import save_head
    from specrt.pipeline import EngineSetRequest, make_engine_set

    config = AutoConfig.from_pretrained(str(tiny_dir))
    shape = HeadShape.of(config)
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("eagle") / "tiny-eagle.npz"
    save_head(path, make_head(shape), np.arange(config.vocab_size), {"shape": shape.__dict__})
    return make_engine_set(EngineSetRequest(str(tiny_dir), "tiny-eagle", ("fp32",), 256, tiny_engines.parent,
                                            eagle_head=path), log=lambda m: None)


@pytest.mark.parametrize("tree", [False, True])
def test_a_random_head_keeps_the_output_exactly_the_targets(eagle_engines, tree):
    from specrt.runtime.sampling import SamplingParams
    from specrt.runtime.session import load
    from specrt.runtime.speculative import SpeculativeConfig

    plain = load(eagle_engines)
    spec = load(eagle_engines, "fp32", "eagle", config=SpeculativeConfig(eagle_tree=tree))
    assert spec.decoder.proposer.name == "eagle" and spec.decoder.proposer.tree is tree
    drafted = 0
    for prompt in ("Tell me about rivers.", "def add(a, b):"):
        # seeded sampling with a deterministic drafter (EAGLE's drafts carry no q) is plain seeded sampling
        for sampling in (SamplingParams(temperature=0.0), SamplingParams(temperature=0.8, seed=3)):
            a = spec.generate(prompt, max_new_tokens=40, sampling=sampling)
            b = plain.generate(prompt, max_new_tokens=40, sampling=sampling)
            assert list(a.token_ids) == list(b.token_ids), (prompt, sampling)
            assert a.stats.proposer == "eagle"
            drafted += sum(a.stats.drafted_by_position)
    assert drafted > 0  # the head drafted and the target rejected, not a loop that never drafted


class OracleHead:
    """A head that knows the answer: a row at position p guesses oracle[p + 2] first (the token two past it, as a
    real head's row does), then other tokens; its features are noise. It drives the proposer through long accepted
    chains and tree paths, which a random head never reaches."""

    on_device = False  # takes host rows

    def __init__(self, oracle: list[int], capacity: int = 320, hidden: int = 64, topk: int = 4, vocab: int = 384):
        self.oracle, self.capacity, self.hidden_size, self.topk, self.vocab = oracle, capacity, hidden, topk, vocab
        self.max_capacity, self.length, self.calls = capacity, 0, []

    def reserve(self, slots, keep=None):
        assert slots <= self.capacity

    def run(self, features, tokens, positions, slot, mask):
        W = len(tokens)
        self.calls.append((features.copy(), np.array(tokens), np.array(positions), slot))
        top = np.empty((W, self.topk), np.int64)
        for r, p in enumerate(positions):
            best = self.oracle[p + 2] if p + 2 < len(self.oracle) else 0
            top[r] = [best] + [(best + 1 + j) % self.vocab for j in range(self.topk - 1)]
        logp = np.log(np.array([0.7] + [0.3 / (self.topk - 1)] * (self.topk - 1), np.float32))
        return np.random.default_rng(W).standard_normal((W, self.hidden_size)).astype(np.float32), top, \
            np.tile(logp, (W, 1))


@pytest.mark.parametrize("tree", [False, True])
def test_an_oracle_head_is_accepted_and_the_head_reads_the_targets_own_features(tiny_engines, tree):
    """With every first guess right, rounds keep whole chains or tree paths; the output is still the target's, and
    every real entry the head read carried the target's feature at that position (what a fresh prefill of the
    whole sequence computes) and the token after it."""
    from specrt.runtime.control import GatedK
    from specrt.runtime.proposers.eagle import Eagle
    from specrt.runtime.sampling import SamplingParams
    from specrt.runtime.session import load
    from specrt.runtime.speculative import SpeculativeDecoder

    session = load(tiny_engines)
    greedy = SamplingParams(temperature=0.0)
    prompt = "Tell me about rivers."
    ref = session.generate(prompt, max_new_tokens=48, sampling=greedy)
    ids = session.generator.prompt_ids(prompt) + list(ref.token_ids)
    head = OracleHead(ids)
    proposer = Eagle(head, max_tokens=4, tree=tree, beam=3, nodes=8)
    out = session.generator.generate(prompt, max_new_tokens=48, sampling=greedy,
                                     decode=SpeculativeDecoder(proposer, GatedK(4)))
    assert list(out.token_ids) == list(ref.token_ids)
    assert out.stats.tau > 3.0, out.stats.tau
    engine = session.engine
    engine.rewind(0)
    engine.enable_hidden()
    engine.forward(np.asarray(ids, np.int64))
    truth = engine.hidden.copy()
    real = [(f, t, p) for f, t, p, slot in head.calls if slot == p[0] and len(p) and p[0] < len(ids) - 2]
    seen = 0
    for feats, toks, pos in real:
        for f, t, p in zip(feats, toks, pos):
            if p < len(truth) and np.allclose(f, truth[p], atol=1e-3):
                assert t == ids[p + 1]
                seen += 1
    assert seen >= len(ids) - 8  # every position but the last few was read with its own feature


def test_train_eagle_bad_input_is_one_line_before_any_work(tmp_path):
    from typer.testing import CliRunner

    from specrt.cli import app

    for args, says in ((["--epochs", "0"], "--epochs must be > 0"), (["--budget-minutes", "0"], "--budget-minutes"),
                       (["--vocab", "-1"], "--vocab and --w-cls must be >= 0")):
        r = CliRunner().invoke(app, ["train-eagle", "--work", str(tmp_path), *args])
        assert r.exit_code == 2 and says in r.output and "Traceback" not in r.output, r.output
        assert len(r.output.strip().splitlines()) == 1
    assert not any(tmp_path.iterdir())  # nothing written


def test_an_eagle_head_for_another_target_is_refused_at_load(eagle_engines, tmp_path):
    import json
    import shutil

    from specrt.errors import SpecrtError
    from specrt.manifest import load_manifest

    root = tmp_path / "set"
    shutil.copytree(eagle_engines, root)
    m = json.loads((root / "manifest.json").read_text())
    assert m["engines"]["eagle-int8"]["eagle"]["target_source_sha256"] == m["engines"]["target-fp32"]["source_sha256"]
    m["engines"]["eagle-int8"]["eagle"]["target_source_sha256"] = "0" * 64
    (root / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(SpecrtError, match="EAGLE head for another target"):
        load_manifest(root)


def test_lookup_then_eagle_keeps_the_output_exactly_the_targets(eagle_engines):
    from specrt.runtime.sampling import SamplingParams
    from specrt.runtime.session import load

    plain, spec = load(eagle_engines), load(eagle_engines, "fp32", "lookup+eagle")
    prompt = "def add(a, b):\n    return a + b\n def add(a, b):"
    greedy = SamplingParams(temperature=0.0)
    a, b = spec.generate(prompt, max_new_tokens=40, sampling=greedy), plain.generate(prompt, max_new_tokens=40,
                                                                                     sampling=greedy)
    assert list(a.token_ids) == list(b.token_ids) and a.stats.proposer == "lookup+eagle"


def test_eagle_streams_in_a_batch_keep_the_targets_output(eagle_engines):
    """--speculate eagle with --parallel 2: each slot has its own head (and head cache); each stream's greedy tokens
    equal plain decoding's."""
    from test_batch import GREEDY, PROMPTS, gathering, run_threads

    from specrt.runtime.session import load

    jobs = [(PROMPTS[0], 50, 0.0), (PROMPTS[2], 40, 0.0), (PROMPTS[3], 30, 0.0)]
    alone = load(eagle_engines, "fp32", "off")
    want = [alone.generate(p, max_new_tokens=n, sampling=GREEDY, ignore_eos=True).token_ids for p, n, _ in jobs]
    batched = gathering(load(eagle_engines, "fp32", "eagle", parallel=2), 2)
    assert run_threads(batched, jobs) == want
    heads = {id(s.decoder.proposer.head) for s in batched.slots}
    assert len(heads) == 2


@pytest.mark.parametrize("spec, message", [("fuse:{\"fused\": true}", "unknown fields fused"),
                                           ("fuse:{fuse}", "does not parse"), (":{}", "no name")])
def test_eagle_variants_names_a_bad_variant_before_any_work(spec, message, capsys):
    from experiments.eagle_variants import main

    with pytest.raises(SystemExit) as e:
        main([spec])
    assert e.value.code == 2 and message in capsys.readouterr().err


# --- the head beside a target on the device (compiled: tensorrt backends; the CUDA EP: onnxruntime-cuda), on
# host-memory fakes ---------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def fake_gpu_eagle(tmp_path_factory):
    """A random portable target (hidden 32, vocab 96) and a random EAGLE head for it, the head's graph with its
    cache capacity fixed at 320 as build/tensorrt.py compiles it."""
    from gpu_fakes import random_portable

    from specrt.build.tensorrt import fix_capacity
    from specrt.export.eagle import export_eagle_onnx, save_head

    out = tmp_path_factory.mktemp("fake-gpu-eagle")
    random_portable(out / "target-fp32.onnx")
    torch.manual_seed(0)
    save_head(out / "head.npz", make_head(SHAPE), np.arange(96), {"shape": SHAPE.__dict__})
    rng = np.random.default_rng(0)
    embed, lm_head = rng.standard_normal((2, 96, 32)).astype(np.float32)
    export_eagle_onnx(out / "head.npz", embed, lm_head, out / "eagle.onnx", 256, 8)
    (out / "eagle-fixed.onnx").write_bytes(fix_capacity(out / "eagle.onnx", 320))
    return out


GPU_BACKENDS = ["tensorrt", "onnxruntime-cuda"]


def _gpu_eagle(root, tree: bool, on_device: bool = True, backend: str = "tensorrt"):
    """(target, head, proposer): the backend's engine and EAGLE head over host-memory fakes (CountingMemory):
    a TensorRT target and TrtEagleHead (TensorRT faked), or a CUDA EP one and OrtCudaEagleHead (a CPU session bound by
    address, 16 rows a call as the fake compiled head's prefill profile), the head reading the target's rows on the
    device, or with on_device False the same head class on the host path."""
    from gpu_fakes import fake_target

    head, proposer = _eagle_on(root, tree, on_device, backend)
    return fake_target(root / "target-fp32.onnx", backend), head, proposer


def _eagle_on(root, tree: bool, on_device: bool, backend: str):
    """_gpu_eagle's (head, proposer), without the target."""
    import onnxruntime as ort
    from gpu_fakes import CountingMemory, HostEagleEngine

    from specrt.runtime.backends.onnxruntime_cuda import OrtCudaEagleHead
    from specrt.runtime.backends.tensorrt.heads import TrtEagleHead
    from specrt.runtime.proposers.eagle import Eagle

    dims = dict(name="eagle-fp32", hidden=32, kv_heads=2, head_dim=8, topk=8)
    if backend == "tensorrt":
        head = TrtEagleHead(HostEagleEngine(root / "eagle-fixed.onnx", max_rows=16, max_width=4), CountingMemory(),
                            **dims)
    else:
        session = ort.InferenceSession(str(root / "eagle.onnx"), providers=["CPUExecutionProvider"])
        head = OrtCudaEagleHead(session, CountingMemory(), capacity=320, max_rows=16, device="cpu", **dims)
    if not on_device:
        head.on_device = False
    return head, Eagle(head, max_tokens=4, tree=tree, beam=3, nodes=8)


PROMPT = np.random.default_rng(5).integers(0, 96, 37)  # wider than the fake head's 16 prefill rows: chunks


@pytest.mark.parametrize("backend", GPU_BACKENDS)
@pytest.mark.parametrize("tree", [False, True])
def test_eagle_features_stay_on_the_device_beside_a_gpu_target(fake_gpu_eagle, tree, backend):
    """The device path (the target's accepted rows copied on the device into the head's store, the head's
    predicted features fed back by address) against the host path of the same head class, round by round through
    long forced accepts: the same drafts, tokens and kept features; no hidden or feature row downloaded on the
    device path (the host path downloads both); KV reuse's copy of the features equal. A device copy skipped, or
    of the wrong rows, drafts otherwise. For a compiled head (TensorRT) and one on the CUDA EP."""
    from specrt.interface import HIDDEN_STATES
    from gpu_fakes import hidden_fetched, speculate

    host_t, host_h, host_p = _gpu_eagle(fake_gpu_eagle, tree, on_device=False, backend=backend)
    want, host_drafts = speculate(host_t, host_p, PROMPT, 60, 4, forced=True)
    assert not host_p._device and max(len(t) for t, _ in host_drafts) > 1
    target, head, proposer = _gpu_eagle(fake_gpu_eagle, tree, backend=backend)
    got, drafts = speculate(target, proposer, PROMPT, 60, 4, forced=True)
    assert proposer._device and drafts == host_drafts and got == want
    # what crossed to the host: on the device path no row of the target's hidden states, nor of the head's
    # features (its outputs or its store); the host path fetches both
    rows = head.max_rows * head.hidden_size * 4
    assert hidden_fetched(target) == 0 and len(target.hidden) == 0
    assert head.memory.fetched(head._device[HIDDEN_STATES], rows) == 0
    assert head.memory.fetched(head._store, head.capacity * head.hidden_size * 4) == 0
    assert hidden_fetched(host_t) > 0 and host_h.memory.fetched(host_h._device[HIDDEN_STATES], rows) > 0
    n = proposer._known
    assert n == host_p._known > len(PROMPT) + 40
    np.testing.assert_array_equal(head.read_features(n), host_p._feat[:n])  # the store holds the same rows
    saved, host_saved = proposer.save_state(n), host_p.save_state(n)
    np.testing.assert_array_equal(saved.feat, host_saved.feat)
    for a, b in zip(saved.cache.arrays, host_saved.cache.arrays):
        np.testing.assert_array_equal(a, b)
    kept = host_saved.cache.length  # the head's positions (its last rows are read next round)
    proposer.load_state(np.zeros(kept, np.int64), host_saved)  # a prefix kept across requests: back in the store
    np.testing.assert_array_equal(head.read_features(kept), host_saved.feat)
    # a call's feature outputs hold until the next call; of a call in chunks, the last chunk's rows only
    mask, one = np.zeros((20, head.capacity), np.float32), np.array([1])
    f = head.run(head.stored(0, 1), one, one, kept, mask[:1])[0]
    head.run(f, one, one, kept + 1, mask[:1])
    with pytest.raises(ValueError, match="since overwritten"):
        head.run(f, one, one, kept + 1, mask[:1])
    wide = head.run(head.stored(0, 20), np.ones(20, np.int64), np.arange(20), kept, mask)[0]
    assert (wide.addresses[:16] == 0).all() and (wide.addresses[16:] > 0).all()
    # the test sees a device copy skipped, or one of the wrong rows
    for sabotage in ("skip", "shift"):
        target, head, proposer = _gpu_eagle(fake_gpu_eagle, tree, backend=backend)
        if sabotage == "skip":
            head.keep_features = lambda position, addresses: None
        else:
            rows_of = target.hidden_addresses
            target.hidden_addresses = lambda rows: rows_of(np.asarray(rows) + 1)
        assert speculate(target, proposer, PROMPT, 60, 4, forced=True)[1] != host_drafts, sabotage


@pytest.mark.parametrize("backend", GPU_BACKENDS)
@pytest.mark.parametrize("tree", [False, True])
def test_greedy_eagle_on_the_device_keeps_the_targets_output(fake_gpu_eagle, tree, backend):
    """Greedy speculative decoding with the head on the device path (real verification) gives plain greedy
    decoding's tokens, and drafts on the way."""
    from gpu_fakes import fake_target, hidden_fetched, plain, speculate

    target, _, proposer = _gpu_eagle(fake_gpu_eagle, tree, backend=backend)
    got, drafts = speculate(target, proposer, PROMPT, 50, 4)
    assert proposer._device and sum(len(t) for t, _ in drafts) > 0 and hidden_fetched(target) == 0
    assert got == plain(fake_target(fake_gpu_eagle / "target-fp32.onnx", backend), PROMPT, 50)


@pytest.mark.parametrize("backend", GPU_BACKENDS)
@pytest.mark.parametrize("tree, chunk", [(True, 0), (True, 16), (False, 16)])
def test_eagle_streams_in_a_batch_keep_their_features_on_the_device(fake_gpu_eagle, backend, tree, chunk):
    """Three EAGLE streams at once over a GPU backend's batch engine (fakes; a head each, as --parallel opens them),
    one prompt run alone beside the batched ones or, with chunk, read in chunks while the others decode (its
    features span the chunks' passes): with the heads on the device, each stream's drafts and tokens are those of
    the host path in the same batch and of the stream alone beside a single-stream target, through long forced
    accepts, and no hidden or feature row is downloaded; greedy output equals plain decoding's. A stream that
    reads another slot's rows, a stale pass's, or a chunk's rows copied to the wrong offset drafts otherwise."""

    from specrt.interface import HIDDEN_STATES
    from gpu_fakes import (batch_hidden_fetched, batch_sabotages, fake_batch, fake_target, plain, speculate,
                                   speculate_batch)

    rng = np.random.default_rng(5)
    prompts = [PROMPT, rng.integers(0, 96, 100), rng.integers(0, 96, 9)]

    def batched(on_device: bool = True, forced: bool = True, sabotage=None):
        batch = fake_batch(fake_gpu_eagle / "target-fp32.onnx", backend)
        if sabotage:
            sabotage(batch)
        stacks = [_eagle_on(fake_gpu_eagle, tree, on_device, backend) for _ in prompts]
        out, _ = speculate_batch(batch, [p for _, p in stacks], prompts, 40, 4, forced, chunk)
        assert all(p._device == on_device for _, p in stacks)
        return [o[0] for o in out], [o[1] for o in out], batch, [h for h, _ in stacks]

    want, host_drafts, host_batch, _ = batched(on_device=False)
    assert batch_hidden_fetched(host_batch) > 0 and all(max(len(t) for t, _ in d) > 1 for d in host_drafts)
    got, drafts, batch, heads = batched()
    assert drafts == host_drafts and got == want and batch_hidden_fetched(batch) == 0
    for h in heads:  # nor any of the heads' features
        assert h.memory.fetched(h._device[HIDDEN_STATES], h.max_rows * 128) == 0
        assert h.memory.fetched(h._store, h.capacity * 128) == 0
    for s, p in enumerate(prompts):  # each stream alone beside a single-stream target, on the device
        target, _, proposer = _gpu_eagle(fake_gpu_eagle, tree, backend=backend)
        assert speculate(target, proposer, p, 40, 4, forced=True) == (want[s], host_drafts[s])

    for sabotage in batch_sabotages(chunk):
        assert batched(sabotage=sabotage)[1] != host_drafts, sabotage.__name__
    greedy = batched(forced=False)[0]
    assert greedy == [plain(fake_target(fake_gpu_eagle / "target-fp32.onnx", backend), p, 40) for p in prompts]


def test_device_feature_rows_are_gathered_and_refused_when_overwritten():
    """rows_plan packs rows that follow each other at their source into one copy; DeviceRows keep the epoch of
    the call whose outputs they are, and a joined level of mixed epochs is refused by a head."""
    from specrt.runtime.backends.device.memory import DeviceRows, rows_plan

    plan = rows_plan(5000, 16, [100, 116, 132, 300, 100])
    assert [(c.dst, c.src, c.width) for c in plan] == [(5000, 100, 48), (5048, 300, 16), (5064, 100, 16)]
    assert all(c.height == 1 and c.dpitch == c.spitch == c.width for c in plan)
    with pytest.raises(ValueError, match="no longer on the device"):
        rows_plan(5000, 16, [100, 0])
    rows = DeviceRows([10, 20, 30], epoch=4)
    assert len(rows[-1:]) == 1 and rows[0].epoch == 4 and list(rows.join([rows[2], rows[0]]).addresses) == [30, 10]
    assert rows.join([rows[0], DeviceRows([7])]).epoch == -1


def test_the_cuda_ep_head_drafts_what_the_cpu_head_does(fake_gpu_eagle):
    """OrtCudaEagleHead (every buffer in HostMemory, bound by address to a CPU session of the graph) against
    OrtEagleHead on the CPU: the same next features and top-k for a prompt wider than its rows a call (run in
    chunks), chain steps and a tree level, and after its cache is saved and loaded back."""
    import onnxruntime as ort

    from specrt.runtime.backends.device.memory import HostMemory
    from specrt.runtime.backends.onnxruntime_cpu.heads import OrtEagleHead
    from specrt.runtime.backends.onnxruntime_cuda import OrtCudaEagleHead
    from gpu_fakes import eagle_heads_agree

    graph = fake_gpu_eagle / "eagle.onnx"
    dims = dict(hidden=32, kv_heads=2, head_dim=8, topk=8)

    def cuda_head():
        session = ort.InferenceSession(str(graph), providers=["CPUExecutionProvider"])
        return OrtCudaEagleHead(session, HostMemory(), name="eagle-fp32", capacity=320, max_rows=16, device="cpu",
                                **dims)

    gpu, cpu = cuda_head(), OrtEagleHead(graph, capacity=320, **dims)
    cpu.reserve(320)
    assert gpu.capacity == gpu.max_capacity == cpu.capacity == 320 and gpu.on_device
    eagle_heads_agree(gpu, cpu, 32, 96, np.random.default_rng(0), cuda_head)  # the prompt 16 rows at a time


def test_an_onnxruntime_cuda_sets_eagle_head_opens_on_the_cuda_ep(fake_gpu_eagle, monkeypatch):
    """The runtime opens an onnxruntime-cuda set's eagle-fp32 entry through its backend as OrtCudaEagleHead at the
    entry's capacity and top-k, its session made on the CUDA EP with the head's own stream (the GPU's pieces
    faked here); where this onnxruntime has no CUDA EP, one line."""
    import onnxruntime as ort

    from specrt.errors import SpecrtError
    from specrt.manifest import EngineEntry
    from specrt.runtime.backends import onnxruntime_cuda
    from specrt.runtime.backends.device.memory import HostMemory
    from specrt.runtime.engine import open_eagle

    entry = EngineEntry(name="eagle-fp32", role="eagle", file="eagle.onnx", backend="onnxruntime-cuda",
                        precision="fp32", num_layers=1, num_heads=4, num_kv_heads=2, head_dim=8, hidden_size=32,
                        vocab_size=96, max_context=256, eagle={"capacity": 320, "topk": 8})
    if "CUDAExecutionProvider" not in ort.get_available_providers():
        with pytest.raises(SpecrtError, match="runs on the CPU only"):
            open_eagle(fake_gpu_eagle, entry)
    opened = []
    monkeypatch.setattr(onnxruntime_cuda, "require_cuda_provider", lambda providers: None)
    monkeypatch.setattr(onnxruntime_cuda, "require_device", lambda backend: None)
    monkeypatch.setattr(onnxruntime_cuda, "CudaMemory", HostMemory)
    monkeypatch.setattr(onnxruntime_cuda, "open_session", lambda path, stream, threads, graphs: opened.append(
        (path.name, stream, threads, graphs)) or (ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]),
                                                  None))
    head = open_eagle(fake_gpu_eagle, entry)
    assert isinstance(head, onnxruntime_cuda.OrtCudaEagleHead) and head.on_device and head.device == "cuda"
    assert (head.capacity, head.topk, head.max_rows, head.hidden_size) == (320, 8, 320, 32)
    assert opened == [("eagle.onnx", 0, 1, False)]


def test_the_eagle_head_of_a_gpu_set_is_the_standard_op_graph(tiny_dir, tiny_engines, tmp_path, monkeypatch):
    """Sets whose head runs on the GPU (a TensorRT compiler's, onnxruntime-cuda's) get eagle-fp32, the fp32 graph
    of standard ops, as an entry of their backend; the others eagle-int8 on ONNX Runtime's CPU provider."""
    import json

    import onnx
    from transformers import AutoConfig

    from specrt.export.eagle import save_head
    from specrt.export.sources import fingerprint, resolve
    from specrt.pipeline import eagle as pipeline_eagle

    assert {b: pipeline_eagle.on_gpu(b) for b in ("onnxruntime", "onnxruntime-portable", "onnxruntime-cuda",
                                                  "tensorrt", "tensorrt-rtx")} == {
        "onnxruntime": False, "onnxruntime-portable": False, "onnxruntime-cuda": True, "tensorrt": True,
        "tensorrt-rtx": True}
    config = AutoConfig.from_pretrained(str(tiny_dir))
    shape = HeadShape.of(config)
    torch.manual_seed(0)
    head = tmp_path / "head.npz"
    save_head(head, make_head(shape), np.arange(config.vocab_size), {"shape": shape.__dict__})
    fp = fingerprint(resolve(str(tiny_dir)))
    cache = next((tiny_engines.parent / ".cache").glob(f"export-{fp[:16]}-ctx256-*"))
    facts = json.loads((cache / "export.json").read_text())
    monkeypatch.setattr(pipeline_eagle, "target_pass_costs", lambda *a: [[1, 0.01], [8, 0.02]])
    out = tmp_path / "set"
    out.mkdir()
    entry = pipeline_eagle.build_eagle(head, cache, facts, out, lambda m: None, {}, backend="onnxruntime-cuda")
    assert (entry.name, entry.backend, entry.precision, entry.file) == ("eagle-fp32", "onnxruntime-cuda", "fp32",
                                                                        "eagle-fp32.onnx")
    assert sorted(p.name for p in out.iterdir()) == sorted(entry.files) and entry.eagle["capacity"] == 320
    ops = {n.op_type for n in onnx.load(str(out / entry.file), load_external_data=False).graph.node}
    assert {"RotaryEmbedding", "TensorScatter", "Attention"} <= ops
    assert not ops & {"DynamicQuantizeLinear", "MatMulInteger"}
