"""The compressed tp all-reduce (--tp-comm int8): blockwise int8 format, error bound, same bits on every rank,
bytes on the wire, the flag's launch checks, and a tp=2 generate run."""
import argparse
import subprocess
import sys

import pytest
import torch

from tensorpar import comm
from tensorpar.comm.compress import BLOCK, all_reduce_int8, dequantize_int8, payload_bytes, quantize_int8
from tests.decode.test_generate_cli import tiny_with_tokenizer  # noqa: F401  (the fixture: a random llama + tokenizer)

# The bound is scale/2 per element (round to nearest); x / scale and q * scale each round once in float32, so
# allow 4 float32 ulps of the block's absmax on top (absmax * 2**-21).
ULP = 2.0 ** -21


def _partial(r: int, n: int, dtype=torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 + r)
    x = torch.randn(n, generator=g) * torch.logspace(-3, 2, n)[torch.randperm(n, generator=g)]  # mixed magnitudes
    x[:BLOCK] = 0.0                                    # an all-zero block (scale 0)
    return x.to(dtype)


def _bound(parts: list[torch.Tensor]) -> torch.Tensor:
    """Per-element bound of the int8 sum against the exact sum: sum over ranks of (scale/2 + ulps of absmax)."""
    n = parts[0].numel()
    tot = torch.zeros(n)
    for x in parts:
        _, s = quantize_int8(x)
        amax = s * 127
        tot += (s / 2 + amax * ULP).repeat_interleave(BLOCK)[:n]
    return tot


def test_quantize_roundtrip_within_half_a_step():
    for n in (1, 31, 32, 100, 4096 + 7):               # partial last blocks included
        x = _partial(0, 64)[-n:] if n < BLOCK else _partial(0, n)
        q, s = quantize_int8(x)
        assert q.dtype == torch.int8 and q.shape == (n,) and s.dtype == torch.float32 and s.shape == (-(-n // 32),)
        assert int(q.abs().max()) <= 127
        err = (dequantize_int8(q, s) - x).abs()
        assert torch.all(err <= _bound([x])), float((err - _bound([x])).max())
        assert payload_bytes(n) == 4 * s.numel() + 4 * -(-n // 4)     # int8 values padded to 4 bytes
    z = torch.zeros(40)
    q, s = quantize_int8(z)
    assert torch.equal(dequantize_int8(q, s), z) and torch.equal(s, torch.zeros(2))


def test_nonfinite_partial_gives_nonfinite_block():
    x = torch.ones(64)
    x[40] = float("inf")
    d = dequantize_int8(*quantize_int8(x))
    assert torch.isfinite(d[:32]).all() and not torch.isfinite(d[32:]).any()


def test_the_c_kernel_gives_the_pytorch_paths_bits():
    """csrc/q8_comm.cpp (the CPU's quantization and dequantized sum) against compress.py's PyTorch ops: the same
    payload bytes and the same sum, bit for bit, at partial last blocks, zero blocks, extreme magnitudes and at
    values whose product with 127 / absmax lands next to a half (the first draft divided where PyTorch's
    ``127 / t`` takes the reciprocal and multiplies: 1 value in about 300 000 rounded the other way)."""
    from tensorpar.comm import compress as c
    lib = c._lib()
    if lib is None:
        pytest.skip("no C++ compiler or TENSORPAR_COMM_KERNEL=0: the PyTorch path runs alone")

    def payloads(x):
        n, nb = x.numel(), -(-x.numel() // BLOCK)
        a = torch.zeros(payload_bytes(n), dtype=torch.uint8)
        b = torch.zeros(payload_bytes(n), dtype=torch.uint8)
        a.fill_(255)                                   # the kernel writes the padding zeros itself
        lib.tp_q8c_quantize(x.data_ptr(), n, a.data_ptr(), a.data_ptr() + 4 * nb, payload_bytes(n) - 4 * nb - n)
        c._quantize_into(x, b[:4 * nb].view(torch.float32), b[4 * nb:4 * nb + n].view(torch.int8))
        assert torch.equal(c.encode(x), a)            # the library's entry, the kernel where it runs
        return a, b

    g = torch.Generator().manual_seed(7)
    for n in (1, 31, 32, 33, 576, 4099, 300_000):
        for scale in (1.0, 1e-30, 1e30, 1e-37):
            x = torch.randn(n, generator=g) * scale
            x[BLOCK:2 * BLOCK] = 0.0
            a, b = payloads(x)
            assert torch.equal(a, b), (n, scale, (a != b).nonzero()[:4].flatten().tolist())
    for t in (2, 3):
        for n in (1, 33, 4099):
            nb, m = -(-n // BLOCK), payload_bytes(n)
            gathered = torch.stack([payloads(_partial(r, n))[1] for r in range(t)])
            d = c._dequantize_rows(gathered[:, 4 * nb:4 * nb + n].view(torch.int8),
                                   gathered[:, :4 * nb].view(torch.float32))
            want = d[0]
            for r in range(1, t):
                want = want + d[r]
            got = torch.empty(n)
            lib.tp_q8c_dequant_sum(gathered.data_ptr(), t, m, n, got.data_ptr())
            assert torch.equal(got, want[:n]), (t, n)


def test_encode_and_decode_sum_match_the_pytorch_path_on_awkward_inputs(monkeypatch):
    """The library's entries (not the raw kernel): nan, inf, tiny and zero blocks, bf16 and fp16, a transposed
    view, 0 elements; the same payload bytes and sum bits with the kernel as with the PyTorch path, mixed payloads
    included (a rank without the kernel next to one with it). Review: a NaN block's scale kept the input's NaN
    bits, and the PyTorch path cast inf and nan to int8 (undefined) where the kernel stores 0."""
    from tensorpar.comm import compress as c
    if c._lib() is None:
        pytest.skip("no C++ compiler or TENSORPAR_COMM_KERNEL=0: the PyTorch path runs alone")
    g = torch.Generator().manual_seed(3)
    base = torch.randn(8, 40, generator=g)
    base[0, :5] = float("nan")
    base[1, 3] = float("inf")
    base[2, :] = -float("inf")
    base[3, :] = 2e-37                                  # below 127 / FLT_MAX: stored as 0 on both paths
    base[4, :] = 0.0
    signalling_nan = torch.tensor([0x7F800001], dtype=torch.int32).view(torch.float32)[0]
    assert torch.isnan(signalling_nan)
    base.view(-1)[200] = signalling_nan
    inputs = [base, base.t(), base.to(torch.bfloat16), base.to(torch.float16), torch.zeros(0), base[:, :33]]
    for x in inputs:
        with_kernel = c.encode(x)
        monkeypatch.setattr(c, "_lib", lambda: None)
        without = c.encode(x)
        mixed = torch.stack([with_kernel, without])
        want = c.decode_sum(mixed, x.numel())
        monkeypatch.undo()
        assert torch.equal(with_kernel, without), (x.dtype, x.shape)
        got = c.decode_sum(mixed, x.numel())
        assert torch.equal(got.view(torch.int32), want.view(torch.int32)), (x.dtype, x.shape)
    with pytest.raises(ValueError, match="decode_sum: payloads of 72 bytes"):
        c.decode_sum(torch.stack([c.encode(torch.randn(64))] * 2), 100_000)    # read past the payloads before


def test_no_cpu_flags_falls_back_to_the_pytorch_path(monkeypatch):
    """Where /proc/cpuinfo cannot be read (no target's features known) the int8 all-reduce runs its PyTorch ops:
    ``_lib`` ended in StopIteration before (review)."""
    from tensorpar import native
    from tensorpar.comm import compress as c
    x = torch.randn(100, generator=torch.Generator().manual_seed(4))
    want = c.encode(x)
    monkeypatch.setattr(native, "cpu_has_features", lambda features: False)
    c._lib.cache_clear()
    try:
        assert c._lib() is None and torch.equal(c.encode(x), want)
    finally:
        monkeypatch.undo()
        c._lib.cache_clear()
    assert native.cpu_has_features(()) is True


def _job_int8(ctx, n: int, dtype_name: str, fast: bool):
    tp = ctx.tp
    dtype = getattr(torch, dtype_name)
    if fast:
        from tensorpar.shm import disable_fast_collectives, enable_fast_collectives
        enable_fast_collectives(tp, "on")
    try:
        x = _partial(tp.rank, n, dtype).view(-1, n // 8 if n % 8 == 0 else n)
        exact = comm.all_reduce(x.float(), tp)
        tp.compression = "int8"
        with comm.counting(tp) as c:
            y = comm.reduce_from_tp_region(x, tp)
            summary = c.summary()
        # autograd: the compressed forward passes the gradient straight through, as the exact all-reduce does
        xg = x.float().clone().requires_grad_(True)
        yg = comm.reduce_from_tp_region(xg, tp)
        (yg * 3).sum().backward()
        grad_ok = torch.equal(xg.grad, torch.full_like(xg, 3.0))
        return {"y": y, "exact": exact, "summary": summary, "grad_ok": grad_ok, "yg": yg.detach()}
    finally:
        tp.compression = "fp32"
        if fast:
            disable_fast_collectives(tp)


@pytest.mark.parametrize("tp,n,dtype,fast", [(2, 4104, "float32", False), (3, 1000, "float32", False),
                                             (2, 264, "bfloat16", True)])
def test_all_reduce_int8_same_bits_on_every_rank_and_within_bound(pools, tp, n, dtype, fast):
    out = pools(tp).run(_job_int8, n, dtype, fast)
    y0 = out[0]["y"]
    assert y0.dtype == getattr(torch, dtype) and y0.numel() == n
    for o in out[1:]:                                   # identical bits on every rank
        assert torch.equal(o["y"], y0)
    parts = [_partial(r, n, getattr(torch, dtype)) for r in range(tp)]
    exact = out[0]["exact"].reshape(-1)
    bound = _bound(parts)
    if dtype == "bfloat16":                            # plus the final rounding of the fp32 sum to bf16
        bound = bound + (exact.abs() + bound) * 2.0 ** -8
    err = (y0.float().reshape(-1) - exact).abs()
    assert torch.all(err <= bound), float((err - bound).max())
    assert err.max() > 0                               # it is really quantized (an exact path would pass above)
    # one all-gather of the compressed payload, no all-reduce; bytes counted as the group's counter defines them
    s = out[0]["summary"]
    assert set(s) == {"all_gather"} and s["all_gather"]["calls"] == 1
    assert s["all_gather"]["bytes"] == tp * payload_bytes(n)
    wire_int8 = s["all_gather"]["wire_bytes"]
    wire_fp32 = 2 * (tp - 1) / tp * 4 * n             # the ring all-reduce of the fp32 partials
    assert wire_int8 == (tp - 1) * payload_bytes(n)
    assert wire_int8 / wire_fp32 <= {2: 0.29, 3: 0.43}[tp]
    assert all(o["grad_ok"] for o in out)


def test_one_rank_group_is_identity():
    g = comm.Group.single()
    g.compression = "int8"
    x = torch.randn(5)
    assert comm.reduce_partial(x, g) is x and all_reduce_int8(x, g) is x


def test_refuses_integer_tensors():
    g = comm.Group(pg=None, rank=0, size=2)
    with pytest.raises(ValueError, match="floating-point"):
        all_reduce_int8(torch.ones(4, dtype=torch.int64), g)


def _launch_args(*argv):
    from tensorpar.cli import add_launch_arguments
    p = argparse.ArgumentParser()
    add_launch_arguments(p)
    return p.parse_args(list(argv))


def test_tp_comm_flag_checks(capsys, monkeypatch):
    from tensorpar.cli import check_launch_arguments
    for k in ("WORLD_SIZE", "LOCAL_WORLD_SIZE", "RANK"):
        monkeypatch.delenv(k, raising=False)
    assert _launch_args().tp_comm == "fp32"
    with pytest.raises(SystemExit):                    # argparse: one usage line naming the choices
        _launch_args("--tp-comm", "int4")
    assert "invalid choice: 'int4'" in capsys.readouterr().err
    check_launch_arguments(_launch_args("--tp-comm", "int8"))      # one host: allowed, one line says not needed
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "not needed" in err
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    check_launch_arguments(_launch_args("--tp-comm", "int8", "--tp", "4"))      # tp across two hosts: no note
    assert capsys.readouterr().err == ""
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "3")         # 2 hosts of 3 ranks (tp 2 x pp 3): rank 2's group crosses
    check_launch_arguments(_launch_args("--tp-comm", "int8", "--tp", "2"))
    assert capsys.readouterr().err == ""
    # tp 2 inside each of two hosts, pp 2 across them (review: the note was missing, compression ran silently on
    # the shared-memory all-reduce): the same note as on one host
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    check_launch_arguments(_launch_args("--tp-comm", "int8", "--tp", "2"))
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "not needed" in err
    with pytest.raises(ValueError, match="lossy .generate and serve only.; train needs the exact gradients"):
        check_launch_arguments(_launch_args("--tp-comm", "int8"), exact="train needs the exact gradients")


def test_train_refuses_tp_comm_int8():
    r = subprocess.run([sys.executable, "-m", "tensorpar", "train", "--tp-comm", "int8"], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "--tp-comm int8" in lines[0] and "lossy" in lines[0], r.stderr


def test_generate_tp2_tp_comm_int8_runs(tiny_with_tokenizer):
    from tests.decode.test_generate_cli import _cli
    r = _cli("--model", tiny_with_tokenizer, "--tp", "2", "--prompt", "the cat", "--max-new-tokens", "6",
             "--tp-comm", "int8", "--fast-collectives", "off")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "time to first token" in r.stdout and "tokens/s" in r.stdout    # the stats line (as a plain launch's)
    text = r.stdout.splitlines()[0]
    print("greedy text, --tp-comm int8:", repr(text))
    assert text.startswith("the cat") and len(text) > len("the cat")
    assert "--tp-comm int8" in r.stderr and "not needed" in r.stderr   # one host: the note, before any rank starts


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    from tests.decode.test_generate import make_model_folder
    return make_model_folder(tmp_path_factory.mktemp("tpcomm") / "llama", "llama")


def _job_paths(ctx, folder, ids, mask):
    from tensorpar.generate import SamplingConfig, generate_tokens
    from tensorpar.hf.load import build_parallel_model
    model, _ = build_parallel_model(folder, ctx.tp)
    out = {}
    for mode in ("fp32", "int8"):
        ctx.tp.compression = mode
        for path in ("hf", "lean"):
            with comm.counting(ctx.tp) as c:
                tokens = generate_tokens(model, ctx.tp, ids, mask, sampling=SamplingConfig(max_new_tokens=4),
                                         path=path).tokens
                out[mode, path] = (tokens, dict(c.calls))
    ctx.tp.compression = "fp32"
    return out


def test_row_parallel_and_lean_decode_all_reduces_go_int8(pools, tiny_llama):
    """Every partial-sum all-reduce of the module path and of the lean decode loop becomes one all-gather of the
    compressed partials under compression="int8" (the other collectives are unchanged); ranks agree."""
    from tests.decode.test_generate import ARCHS, prompts
    ids, mask = prompts(ARCHS["llama"]["vocab_size"])
    out = pools(2).run(_job_paths, tiny_llama, ids, mask)
    moved = {}
    for path in ("hf", "lean"):
        exact, q = out[0]["fp32", path][1], out[0]["int8", path][1]
        moved[path] = exact.get("all_reduce", 0) - q.get("all_reduce", 0)
        assert moved[path] > 0 and q.get("all_gather", 0) - exact.get("all_gather", 0) == moved[path], (path, exact, q)
        assert torch.equal(out[0]["int8", path][0], out[1]["int8", path][0])
    assert moved["lean"] == moved["hf"], moved      # the lean loop compresses the same all-reduces (2 per layer too)
