"""edl.ops.losses against transformers' own loss functions (torch) and float64 numpy."""

import importlib.util
import types

import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from jaxtyping import TypeCheckError
from transformers.loss.loss_utils import ForCausalLMLoss, ForSequenceClassificationLoss

from edl.ops import losses

# Whether edl.ops.losses was imported under conftest's jaxtyping import hook: then the
# annotations reject mismatched shapes and non-integer labels before the functions' own checks.
_HOOKED = hasattr(losses.causal_lm_loss, "__wrapped__")


def logits_of(hidden, head):
    return jnp.einsum("bsd,vd->bsv", hidden, head, preferred_element_type=jnp.float32)


def unchunked(hidden, head, labels, **kw):
    """The plain reference: full float32 logits, then causal_lm_loss_from_logits."""
    return losses.causal_lm_loss_from_logits(logits_of(hidden, head), labels, **kw)


_STATIC = ("ignore_index", "shift", "softcap")
chunked = jax.jit(losses.causal_lm_loss, static_argnames=(*_STATIC, "chunk_size"))
unchunked_jit = jax.jit(unchunked, static_argnames=_STATIC)


def numpy_lm(hidden, head, labels, mask, *, ignore_index, shift, softcap):
    """float64 loss, accuracy, count and d(loss)/d(hidden, head), by explicit per-token loops."""
    h, w = np.asarray(hidden, np.float64), np.asarray(head, np.float64)
    z = h @ w.T
    logits = z if softcap is None else softcap * np.tanh(z / softcap)
    batch, seq, _ = logits.shape
    total, correct, count = 0.0, 0, 0
    dlogits = np.zeros_like(logits)
    for b in range(batch):
        for t in range(seq):
            j = t + 1 if shift else t  # the position whose label token t predicts
            if j >= seq or labels[b, j] == ignore_index or (mask is not None and not mask[b, j]):
                continue
            y, row = labels[b, j], logits[b, t]
            p = np.exp(row - row.max())
            p /= p.sum()
            total += -np.log(p[y])
            correct += int(np.argmax(row) == y)
            count += 1
            dlogits[b, t] = p - np.eye(len(row))[y]
    denom = max(count, 1)
    dlogits /= denom
    if softcap is not None:
        dlogits *= 1 - np.tanh(z / softcap) ** 2
    grads = (dlogits @ w, np.einsum("bsv,bsd->vd", dlogits, h))
    return total / denom, correct / denom, count, logits, grads


def hf_lm(logits, labels, mask, *, ignore_index, shift):
    """transformers' ForCausalLMLoss; the padded labels are set to ignore_index as a collator
    would (HF's loss takes no attention mask). It upcasts with ``.float()``, i.e. to float32."""
    labels = np.where(mask == 0, ignore_index, labels) if mask is not None else labels
    labels_t = torch.from_numpy(np.asarray(labels, np.int64))
    kw = {"shift_labels": labels_t} if not shift else {}
    return ForCausalLMLoss(
        torch.from_numpy(np.asarray(logits, np.float64)),
        labels_t,
        vocab_size=logits.shape[-1],
        ignore_index=ignore_index,
        **kw,
    ).item()


@st.composite
def lm_cases(draw):
    batch, seq = draw(st.integers(1, 3)), draw(st.integers(1, 9))
    n = batch * seq
    return {
        "batch": batch,
        "seq": seq,
        "vocab": draw(st.integers(2, 17)),
        "dim": draw(st.integers(1, 8)),
        # 1, any split (most not dividing n), exactly n, and more than n (one chunk)
        "chunk_size": draw(st.sampled_from([1, n, n + 3, 4096]) | st.integers(1, n + 1)),
        "ignore_p": draw(st.sampled_from([0.0, 0.3, 1.0])),
        "ignore_index": draw(st.sampled_from([-100, -1, 0])),
        "mask": draw(st.booleans()),
        "shift": draw(st.booleans()),
        "softcap": draw(st.none() | st.floats(0.5, 5.0)),
        "seed": draw(st.integers(0, 2**31 - 1)),
    }


def make_lm_inputs(c, dtype=np.float32):
    rng = np.random.default_rng(c["seed"])
    b, s, v, d = c["batch"], c["seq"], c["vocab"], c["dim"]
    hidden = rng.normal(size=(b, s, d)).astype(dtype)
    head = (2.0 / np.sqrt(d) * rng.normal(size=(v, d))).astype(dtype)  # logits ~ N(0, 4)
    labels = rng.integers(0, v, size=(b, s))
    labels[rng.random((b, s)) < c["ignore_p"]] = c["ignore_index"]
    mask = None
    if c["mask"]:  # left and right padding
        mask = np.zeros((b, s), np.int32)
        for i in range(b):
            left = rng.integers(0, s + 1)
            right = rng.integers(left, s + 1)
            mask[i, left:right] = 1
    return hidden, head, labels.astype(np.int32), mask


def lm_kwargs(c, mask):
    kw = {"ignore_index": c["ignore_index"], "shift": c["shift"], "softcap": c["softcap"]}
    return {**kw, "attention_mask": None if mask is None else jnp.asarray(mask)}


# Tolerances: all three losses compute in float32 (HF's ForCausalLMLoss too, via .float()).
# Logits are O(10) with dim <= 8, so each logsumexp / label logit carries an absolute error of
# a few float32 ulps of 10 (~1e-6); the mean loss (O(1)) then agrees to ~1e-6 absolute.
LOSS_TOL = {"rtol": 1e-5, "atol": 5e-6}


@given(lm_cases())
@settings(max_examples=25)
def test_causal_lm_loss_matches_transformers_and_float64(c):
    hidden, head, labels, mask = make_lm_inputs(c)
    kw = lm_kwargs(c, mask)
    loss, metrics = chunked(
        jnp.asarray(hidden),
        jnp.asarray(head),
        jnp.asarray(labels),
        **kw,
        chunk_size=c["chunk_size"],
    )
    ref_loss, ref_metrics = unchunked_jit(
        jnp.asarray(hidden), jnp.asarray(head), jnp.asarray(labels), **kw
    )
    np_loss, np_acc, np_count, np_logits, _ = numpy_lm(
        hidden,
        head,
        labels,
        mask,
        ignore_index=c["ignore_index"],
        shift=c["shift"],
        softcap=c["softcap"],
    )
    assert loss.dtype == jnp.float32 and metrics["count"].dtype == jnp.int32
    assert float(metrics["loss"]) == float(loss)
    np.testing.assert_allclose(loss, np_loss, **LOSS_TOL)
    np.testing.assert_allclose(ref_loss, np_loss, **LOSS_TOL)
    assert int(metrics["count"]) == int(ref_metrics["count"]) == np_count
    # Argmax over float32 vs float64 logits agrees unless two logits tie to ~1e-6 (a small
    # softcap saturates logits into near-ties): each such token may flip one prediction.
    top2 = np.sort(np_logits.reshape(-1, np_logits.shape[-1]), axis=-1)[:, -2:]
    near_ties = int(np.sum(top2[:, 1] - top2[:, 0] < 1e-5))
    slack = near_ties / max(np_count, 1) + 1e-6
    np.testing.assert_allclose(metrics["accuracy"], np_acc, rtol=0, atol=slack)
    np.testing.assert_allclose(ref_metrics["accuracy"], np_acc, rtol=0, atol=slack)
    hf = hf_lm(np_logits, labels, mask, ignore_index=c["ignore_index"], shift=c["shift"])
    if np_count:
        np.testing.assert_allclose(hf, np_loss, **LOSS_TOL)
    else:
        assert np.isnan(hf) and float(loss) == 0.0  # HF's mean over no targets is 0/0


@given(lm_cases())
@settings(max_examples=10)
def test_causal_lm_loss_gradients_match_unchunked_and_float64(c):
    hidden, head, labels, mask = make_lm_inputs(c)
    kw = lm_kwargs(c, mask)
    args = (jnp.asarray(hidden), jnp.asarray(head), jnp.asarray(labels))
    grad_chunked = jax.jit(
        jax.grad(
            lambda h, w, y: losses.causal_lm_loss(h, w, y, **kw, chunk_size=c["chunk_size"])[0],
            argnums=(0, 1),
        )
    )(*args)
    grad_ref = jax.jit(jax.grad(lambda h, w, y: unchunked(h, w, y, **kw)[0], argnums=(0, 1)))(*args)
    *_, np_grads = numpy_lm(
        hidden,
        head,
        labels,
        mask,
        ignore_index=c["ignore_index"],
        shift=c["shift"],
        softcap=c["softcap"],
    )
    # float32 softmax gradients carry ~eps absolute error per logit (p - 1 cancels for a
    # confident prediction, so relative error is unbounded there); dlogits @ head sums vocab
    # such terms, dlogits.T @ hidden at most one per token (each weighted 1 / count).
    # Elsewhere the float32 results agree to ~1e-6 relative.
    magnitude = max(np.abs(hidden).max(), np.abs(head).max())
    atol = 4 * np.finfo(np.float32).eps * c["vocab"] * magnitude
    for g, r, n in zip(grad_chunked, grad_ref, np_grads, strict=True):
        assert g.dtype == jnp.float32
        np.testing.assert_allclose(g, r, rtol=1e-5, atol=atol)  # chunked vs unchunked
        np.testing.assert_allclose(g, n, rtol=1e-5, atol=atol)  # vs float64 analytic


def _sub_jaxprs(value):
    if hasattr(value, "eqns"):  # Jaxpr
        yield value
    elif hasattr(value, "jaxpr") and hasattr(value.jaxpr, "eqns"):  # ClosedJaxpr
        yield value.jaxpr
    elif isinstance(value, (tuple, list)):
        for v in value:
            yield from _sub_jaxprs(v)


def all_eqns(jaxpr):
    """Every equation of ``jaxpr``, recursing into scan/checkpoint/pjit/cond bodies."""
    for eqn in jaxpr.eqns:
        yield eqn
        for param in eqn.params.values():
            for sub in _sub_jaxprs(param):
                yield from all_eqns(sub)


def largest_intermediate(fn, *args):
    jaxpr = jax.make_jaxpr(fn)(*args).jaxpr
    sizes = [int(np.prod(v.aval.shape)) for e in all_eqns(jaxpr) for v in e.outvars]
    return max(sizes)


def test_chunked_loss_and_gradient_never_hold_full_logits():
    batch, seq, vocab, dim = 2, 16, 64, 8  # dim < batch*seq, so head (vocab, dim) is smaller
    hidden = jax.random.normal(jax.random.key(0), (batch, seq, dim))
    head = jax.random.normal(jax.random.key(1), (vocab, dim))
    labels = jax.random.randint(jax.random.key(2), (batch, seq), 0, vocab)
    full = batch * seq * vocab

    def grad_of(loss_fn):
        return jax.grad(lambda h, w: loss_fn(h, w, labels)[0], argnums=(0, 1))

    for chunk_size in (1, 7, 8, 31):

        def fn(h, w, y, cs=chunk_size):
            return losses.causal_lm_loss(h, w, y, chunk_size=cs)

        assert largest_intermediate(grad_of(fn), hidden, head) < full
        assert largest_intermediate(lambda h, w, f=fn: f(h, w, labels), hidden, head) < full
    # The check can fail: the unchunked reference does hold the full logits.
    assert largest_intermediate(grad_of(unchunked), hidden, head) >= full


def scan_lengths(fn, *args):
    jaxpr = jax.make_jaxpr(fn)(*args).jaxpr
    return [e.params["length"] for e in all_eqns(jaxpr) if e.primitive.name == "scan"]


def test_chunk_size_sets_the_number_of_chunks():
    hidden, head = jnp.ones((2, 5, 4)), jnp.ones((9, 4))
    labels = jnp.zeros((2, 5), jnp.int32)
    for chunk_size, n_chunks in ((1, 10), (3, 4), (10, 1), (2048, 1)):
        fn = lambda h, w, cs=chunk_size: losses.causal_lm_loss(h, w, labels, chunk_size=cs)
        # One chunk is computed directly, without a scan.
        assert scan_lengths(fn, hidden, head) == ([n_chunks] if n_chunks > 1 else [])


def test_one_chunk_computes_the_head_product_once():
    hidden, head = jnp.ones((2, 5, 4)), jnp.ones((9, 4))
    labels = jnp.zeros((2, 5), jnp.int32)

    def head_products(chunk_size):
        fn = lambda h, w: losses.causal_lm_loss(h, w, labels, chunk_size=chunk_size)[0]
        jaxpr = jax.make_jaxpr(jax.grad(fn, argnums=(0, 1)))(hidden, head).jaxpr
        return sum(e.primitive.name == "dot_general" for e in all_eqns(jaxpr))

    # Forward, then the gradients of hidden and head; several chunks also recompute the
    # logits in the backward pass (the rematerialised scan body).
    assert head_products(10) == 3
    assert head_products(3) == 4


@pytest.mark.parametrize("case", ["all_ignored", "all_masked", "single_position"])
def test_no_targets_gives_zero_loss_and_finite_gradients(case):
    seq = 1 if case == "single_position" else 6
    hidden = jax.random.normal(jax.random.key(0), (2, seq, 4))
    head = jax.random.normal(jax.random.key(1), (11, 4))
    labels = jnp.full((2, seq), -100 if case == "all_ignored" else 3, jnp.int32)
    mask = jnp.zeros((2, seq), jnp.bool_) if case == "all_masked" else None

    def fn(h, w):
        return losses.causal_lm_loss(h, w, labels, attention_mask=mask, chunk_size=4)

    value_and_grad = jax.jit(jax.value_and_grad(fn, argnums=(0, 1), has_aux=True))
    (loss, metrics), grads = value_and_grad(hidden, head)
    assert float(loss) == 0.0 and float(metrics["accuracy"]) == 0.0
    assert int(metrics["count"]) == 0
    for g in grads:
        assert bool(jnp.all(g == 0.0))
    ref, _ = unchunked(hidden, head, labels, attention_mask=mask)
    assert float(ref) == 0.0


def test_bfloat16_inputs():
    c = {"batch": 2, "seq": 24, "vocab": 50, "dim": 16, "ignore_p": 0.2, "ignore_index": -100}
    hidden, head, labels, _ = make_lm_inputs({**c, "mask": False, "seed": 0})
    h16, w16 = jnp.asarray(hidden, jnp.bfloat16), jnp.asarray(head, jnp.bfloat16)
    labels = jnp.asarray(labels)
    loss16, metrics16 = chunked(h16, w16, labels, chunk_size=10)
    assert loss16.dtype == jnp.float32 and metrics16["accuracy"].dtype == jnp.float32
    # bf16 products are exact in float32 and accumulated in float32: the same as float32 on
    # the rounded inputs, up to summation order.
    loss_rounded, _ = chunked(h16.astype(jnp.float32), w16.astype(jnp.float32), labels)
    np.testing.assert_allclose(loss16, loss_rounded, rtol=1e-5)
    # Against the unrounded float32 inputs: bf16 rounding (2^-9 relative) of O(3) logits.
    loss32, _ = chunked(jnp.asarray(hidden), jnp.asarray(head), labels, chunk_size=10)
    np.testing.assert_allclose(loss16, loss32, atol=3e-2)
    grad = jax.jit(jax.grad(lambda h, w: chunked(h, w, labels, chunk_size=10)[0], (0, 1)))
    grads = grad(h16, w16)
    assert [g.dtype for g in grads] == [jnp.bfloat16, jnp.bfloat16]
    assert all(bool(jnp.all(jnp.isfinite(g))) for g in grads)


@pytest.mark.parametrize("chunk_size", [5, 4096])
def test_softcap_against_float64_numpy(chunk_size):
    # Large logits (std ~40) so a cap of 30 changes the loss a lot.
    c = {"batch": 2, "seq": 9, "vocab": 13, "dim": 6, "ignore_p": 0.0, "ignore_index": -100}
    hidden, head, labels, _ = make_lm_inputs({**c, "mask": False, "seed": 1})
    head = 20.0 * head
    args = (jnp.asarray(hidden), jnp.asarray(head), jnp.asarray(labels))
    capped, _ = chunked(*args, chunk_size=chunk_size, softcap=30.0)
    capped_ref, _ = unchunked(*args, softcap=30.0)
    plain, _ = chunked(*args, chunk_size=chunk_size)
    np_loss, *_ = numpy_lm(hidden, head, labels, None, ignore_index=-100, shift=True, softcap=30.0)
    np_plain, *_ = numpy_lm(hidden, head, labels, None, ignore_index=-100, shift=True, softcap=None)
    # Logits ~40: float32 absolute error ~1e-5 per logit.
    np.testing.assert_allclose(capped, np_loss, rtol=1e-5, atol=5e-5)
    np.testing.assert_allclose(capped_ref, np_loss, rtol=1e-5, atol=5e-5)
    np.testing.assert_allclose(plain, np_plain, rtol=1e-5, atol=5e-5)
    assert abs(np_loss - np_plain) > 1.0


def test_cross_entropy_any_leading_shape():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(2, 3, 4, 7)).astype(np.float32)
    labels = rng.integers(0, 7, size=(2, 3, 4))
    labels[0, 0] = -100
    where = rng.random((2, 3, 4)) < 0.7
    loss, metrics = losses.cross_entropy(
        jnp.asarray(logits, jnp.bfloat16).astype(jnp.float32),
        jnp.asarray(labels),
        where=jnp.asarray(where),
    )
    x = np.asarray(jnp.asarray(logits, jnp.bfloat16).astype(jnp.float32), np.float64)
    keep = (labels != -100) & where
    lse = np.log(np.exp(x).sum(-1))
    nll = lse - np.take_along_axis(x, np.where(keep, labels, 0)[..., None], -1)[..., 0]
    np.testing.assert_allclose(loss, nll[keep].mean(), rtol=1e-5)
    assert int(metrics["count"]) == keep.sum()
    np.testing.assert_allclose(metrics["accuracy"], (x.argmax(-1) == labels)[keep].mean())


def _unchecked_copy():
    """edl.ops.losses loaded outside jaxtyping's import hook, as it runs in production."""
    spec = importlib.util.spec_from_file_location("_edl_losses_unchecked", losses.__file__)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("checked", [False, True])
def test_invalid_inputs(checked):
    mod = losses if checked else _unchecked_copy()
    hidden, head = jnp.ones((2, 5, 4)), jnp.ones((9, 4))
    labels = jnp.zeros((2, 5), jnp.int32)

    def rejects(match, param):
        if checked and _HOOKED:  # the annotations' type-check error comes first
            return pytest.raises(TypeCheckError, match=f"typechecking parameter '{param}'")
        return pytest.raises(ValueError, match=match)

    with rejects(r"labels must be \(batch, seq\) = \(2, 5\), got shape \(2, 4\)", "labels"):
        mod.causal_lm_loss(hidden, head, labels[:, :4])
    with rejects(r"head must be \(vocab, dim\) with hidden's dim 4, got shape \(9, 3\)", "head"):
        mod.causal_lm_loss(hidden, head[:, :3], labels)
    with rejects("labels must be integer, got dtype float32", "labels"):
        mod.causal_lm_loss(hidden, head, labels.astype(jnp.float32))
    bad_mask = jnp.ones((2, 3), jnp.int32)
    with rejects(
        r"attention_mask must be \(batch, seq\) = \(2, 5\), got shape \(2, 3\)", "attention_mask"
    ):
        mod.causal_lm_loss(hidden, head, labels, attention_mask=bad_mask)
    with rejects(r"labels must have logits' leading shape \(2, 5\), got \(5,\)", "labels"):
        mod.cross_entropy(jnp.ones((2, 5, 9)), labels[0])
    with pytest.raises(ValueError, match="chunk_size must be positive, got 0"):
        mod.causal_lm_loss(hidden, head, labels, chunk_size=0)
    with pytest.raises(ValueError, match="softcap must be positive"):
        mod.causal_lm_loss(hidden, head, labels, softcap=0.0)


# ---------------------------------------------------------------- sequence classification


def hf_seq_cls(logits, labels, num_labels, problem_type):
    config = types.SimpleNamespace(num_labels=num_labels, problem_type=problem_type)
    labels_t = torch.from_numpy(labels if labels.dtype.kind in "iu" else labels.astype(np.float64))
    loss = ForSequenceClassificationLoss(
        labels_t, torch.from_numpy(np.asarray(logits, np.float64)), config
    )
    return loss.item(), config.problem_type  # HF writes the inferred type into the config


seq_cls = jax.jit(losses.sequence_classification_loss, static_argnames="problem_type")


@st.composite
def cls_cases(draw):
    kind = draw(st.sampled_from(["regression", "single", "multi"]))
    num_labels = draw(st.integers(1 if kind == "regression" else 2, 5))
    return {
        "kind": kind,
        "batch": draw(st.integers(1, 5)),
        "num_labels": num_labels,
        "explicit": draw(st.booleans()),  # pass problem_type, or let it be inferred
        "flat_labels": draw(st.booleans()),  # regression with 1 label: (batch,) or (batch, 1)
        "seed": draw(st.integers(0, 2**31 - 1)),
    }


@given(cls_cases())
@settings(max_examples=30)
def test_sequence_classification_matches_transformers(c):
    rng = np.random.default_rng(c["seed"])
    b, n = c["batch"], c["num_labels"]
    logits = (2 * rng.normal(size=(b, n))).astype(np.float32)
    problem_type = {
        "regression": "regression",
        "single": "single_label_classification",
        "multi": "multi_label_classification",
    }[c["kind"]]
    if c["kind"] == "regression":
        labels = rng.normal(size=(b,) if n == 1 and c["flat_labels"] else (b, n))
        labels = labels.astype(np.float32)
    elif c["kind"] == "single":
        labels = rng.integers(0, n, size=(b,))
        labels[rng.random(b) < 0.3] = -100  # HF's cross entropy ignores -100 here too
        labels[0] = rng.integers(0, n)  # at least one counted example
    else:
        labels = (rng.random((b, n)) < 0.5).astype(np.float32)
        labels[:, 0] = rng.random(b)  # soft targets are allowed
    # Inference reads regression only from num_labels == 1 (float labels otherwise mean
    # multi-label), so regression with more labels must be asked for.
    explicit = problem_type if c["explicit"] or (c["kind"] == "regression" and n > 1) else None
    loss, metrics = seq_cls(jnp.asarray(logits), jnp.asarray(labels), problem_type=explicit)
    hf_loss, hf_type = hf_seq_cls(logits, labels, n, explicit)
    assert hf_type == problem_type  # HF infers what we generated: our inference is checked
    assert float(metrics["loss"]) == float(loss) and loss.dtype == jnp.float32
    # float32 vs float64 on O(1) values.
    np.testing.assert_allclose(loss, hf_loss, rtol=1e-5, atol=1e-6)
    x = logits.astype(np.float64)
    if c["kind"] == "regression":
        assert "accuracy" not in metrics and int(metrics["count"]) == b
    elif c["kind"] == "single":
        keep = labels != -100
        assert int(metrics["count"]) == keep.sum()
        np.testing.assert_allclose(metrics["accuracy"], (x.argmax(-1) == labels)[keep].mean())
    else:
        assert int(metrics["count"]) == b
        expected = ((x > 0) == (labels > 0.5)).mean()
        np.testing.assert_allclose(metrics["accuracy"], expected, rtol=1e-6)


def test_multi_label_bce_is_stable_for_large_logits():
    logits = jnp.array([[200.0, -200.0, 0.0]])
    labels = jnp.array([[0.0, 1.0, 1.0]])
    loss, metrics = losses.sequence_classification_loss(logits, labels)
    np.testing.assert_allclose(loss, (200 + 200 + np.log(2)) / 3, rtol=1e-6)
    np.testing.assert_allclose(metrics["accuracy"], 0.0)
    g = jax.grad(lambda x: losses.sequence_classification_loss(x, labels)[0])(logits)
    assert bool(jnp.all(jnp.isfinite(g)))


def test_sequence_classification_invalid_inputs():
    logits = jnp.ones((3, 4))
    with pytest.raises(ValueError, match="unknown problem_type 'ranking'"):
        losses.sequence_classification_loss(
            logits, jnp.zeros((3,), jnp.int32), problem_type="ranking"
        )
    with pytest.raises(ValueError, match=r"single-label labels must be \(3,\) .* got \(3, 4\)"):
        losses.sequence_classification_loss(
            logits, jnp.zeros((3, 4), jnp.int32), problem_type="single_label_classification"
        )
    with pytest.raises(ValueError, match=r"multi-label labels must have logits' shape \(3, 4\)"):
        losses.sequence_classification_loss(logits, jnp.zeros((3,)))
    with pytest.raises(
        ValueError, match=r"regression labels must be \(3, 1\) or \(3,\), got \(2,\)"
    ):
        losses.sequence_classification_loss(jnp.ones((3, 1)), jnp.zeros((2,)))
    with pytest.raises(ValueError, match="single-label labels must be integer"):
        losses.sequence_classification_loss(
            logits, jnp.zeros((3,)), problem_type="single_label_classification"
        )
