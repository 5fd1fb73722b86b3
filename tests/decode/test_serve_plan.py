"""`tensorpar serve --plan auto`: the layout chosen in the launching process for a full server (--max-batch rows of
--max-model-len), serve's own rules applied to the choice, bad input refused in one line before any rank starts,
and predicted vs measured from the server's metrics at shutdown."""
import argparse

import pytest

from tests.decode.test_generate_cli import PLAN_DEVICE, SLOW_LINK, _torchrun_env, device_file  # noqa: F401
from tests.decode.test_serve import make_folder


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_folder(tmp_path_factory.mktemp("serveplan") / "tiny")


def _parse(*argv):
    from tensorpar.serve import cli
    p = argparse.ArgumentParser()
    cli.add_arguments(p)
    return p.parse_args(["--port", "0", *argv])


def test_serve_plan_auto_chooses_for_a_full_server(tiny, device_file, monkeypatch, capsys):  # noqa: F811
    """No rank started: 2 ranks on one host -> tp=2, planned as --max-batch rows of --max-model-len (one line
    saying so); 2 hosts of 1 rank at 1 Gbit/s -> tp=1 pp=2 (the generate test's reason), but with --deterministic,
    which serve refuses at pp > 1 (the rule its ranks apply), the runnable runner-up tp=2 pp=1; with a
    --kv-cache-memory, the pool of a stage's layers."""
    from tensorpar.serve import cli
    job = cli.validate(_parse("--model", tiny, "--plan", "auto", "--nproc", "2", "--device-file", device_file,
                              "--max-batch", "4", "--max-model-len", "64"))
    assert (job.parallel.tp, job.parallel.pp) == (2, 1)
    out = capsys.readouterr().out
    assert out.count("\n") == 1 and ("plan (auto) for 2 ranks on 1 host: tp=2 pp=1 (for a full server: --max-batch "
                                     "4 rows of --max-model-len 64 positions, as 32 prompt + 32 new tokens), the "
                                     "fastest that fits and runs") in out, out
    pred = job.task.plan_prediction
    assert pred["layout"] == "tp=2" and pred["batch"] == 4 and pred["decode_ms"] > 0
    _torchrun_env(monkeypatch, 2, 1)
    job = cli.validate(_parse("--model", tiny, "--plan", "auto", "--device-file", device_file, *SLOW_LINK,
                              "--max-batch", "4", "--max-model-len", "64"))
    assert (job.parallel.tp, job.parallel.pp) == (1, 2)
    assert "tp=1 pp=2 (for a full server" in " ".join(capsys.readouterr().out.split())
    job = cli.validate(_parse("--model", tiny, "--plan", "auto", "--device-file", device_file, *SLOW_LINK,
                              "--max-batch", "4", "--max-model-len", "64", "--deterministic"))
    assert (job.parallel.tp, job.parallel.pp) == (2, 1) and job.task.deterministic
    assert "on 2 hosts, link between hosts 0.125 GB/s 500 us: tp=2 pp=1" in " ".join(capsys.readouterr().out.split())
    # serve's KV pool rule (kv_pool): 10000 bytes hold 4 blocks of 16 positions at tp=2 (2 layers x 2 KV heads on
    # rank 0, 2048 bytes each); at tp=1 pp=2 a rank holds one layer's 3 KV heads (1536 bytes): 6 blocks, more than
    # the 4 a request of 64 positions needs, so the faster tp=1 pp=2 runs (issue 23: the old rule counted both
    # layers per stage, 3 blocks, and skipped it); 6000 bytes hold 3 blocks at tp=1 pp=2: skipped, tp=2 cannot run
    job = cli.validate(_parse("--model", tiny, "--plan", "auto", "--device-file", device_file, *SLOW_LINK,
                              "--max-batch", "4", "--max-model-len", "64", "--kv-cache-memory", "10000"))
    assert (job.parallel.tp, job.parallel.pp) == (1, 2) and job.task.num_blocks == 6
    with pytest.raises(ValueError, match=r"no layout of 2 ranks that fits is runnable \(first: tp=1 pp=2: "
                                         r"--kv-cache-memory 6000 holds 3 KV block"):
        cli.validate(_parse("--model", tiny, "--plan", "auto", "--device-file", device_file, *SLOW_LINK,
                            "--max-batch", "4", "--max-model-len", "64", "--kv-cache-memory", "6000"))


def test_link_flags_with_every_rank_on_one_host_say_so(tiny, device_file, monkeypatch, capsys):  # noqa: F811
    """Issue 23: --inter-node-bw / --inter-node-latency-us with every rank on this host (no torchrun, or torchrun
    with one node) were taken without a word; one line says they are not needed there (the rule of `tensorpar
    plan` on one node and of train --plan: tensorpar.planner.cluster.note_unused_link), before any rank starts, and
    it is the only one (no unit note for a value that is not used). Across two hosts nothing is said."""
    from tensorpar.serve import cli

    def notes():
        return [ln for ln in capsys.readouterr().err.splitlines() if "--inter-node" in ln]
    flags = ["--device-file", device_file, *SLOW_LINK, "--max-batch", "4", "--max-model-len", "64"]
    cli.validate(_parse("--model", tiny, "--plan", "auto", "--nproc", "2", *flags))
    assert notes() == ["tensorpar: note: --inter-node-bw 0.125 and --inter-node-latency-us 500: all 2 ranks are on "
                       "this host (no torchrun across hosts): no group crosses the link between hosts, so it is not "
                       "needed here"]
    cli.validate(_parse("--model", tiny, "--plan", "auto", "--nproc", "2", *flags[:2], "--inter-node-bw", "5000",
                        *flags[6:]))     # an implausible value (a unit slip?) that is unused here: one note, not two
    got = notes()
    assert len(got) == 1 and got[0].startswith("tensorpar: note: --inter-node-bw 5000: all 2 ranks are on this "
                                               "host"), got
    _torchrun_env(monkeypatch, 2, 2)
    cli.validate(_parse("--model", tiny, "--plan", "auto", *flags))
    got = notes()
    assert len(got) == 1 and "all 2 ranks are on this host (torchrun with one node): no group crosses" in got[0], got
    _torchrun_env(monkeypatch, 2, 1)
    cli.validate(_parse("--model", tiny, "--plan", "auto", *flags))
    assert notes() == []


@pytest.mark.parametrize("args,msg", [
    (["--nproc", "2", "--tp", "1"], "--plan auto chose tp=2 pp=1 for 2 ranks, but --tp 1 was given; drop --tp"),
    (["--nproc", "2", "--pp", "2"], "but --pp 2 was given"),
    (["--nproc", "40"], "--plan auto: no tp x pp layout of 40 ranks splits --model"),
    # 2 GiB usable (4 GiB less the 2 reserved); 10^7 rows of 128 positions need ~2.3 GiB of KV cache per rank at tp=2
    (["--nproc", "2", "--max-batch", "10000000"], "--plan auto: no layout of 2 ranks fits; the smallest, tp=2, needs "),
    (["--nproc", "2", "--quantize", "int8"], "--plan auto and --quantize int8"),
])
def test_serve_plan_auto_bad_input_is_one_line_before_any_rank(tiny, device_file, capsys, args, msg):  # noqa: F811
    from tensorpar.serve import cli
    assert cli.main(_parse("--model", tiny, "--plan", "auto", "--device-file", device_file, *args)) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and msg in err, err
    if "fits" in msg:
        assert "use more ranks or a lower --max-batch or --max-model-len" in err, err


def test_serve_comparison_line_reads_the_metrics():
    """At shutdown: the predicted decode step next to the mean time between a request's tokens the server's
    Prometheus metrics counted (sum / count of the histogram), and the mean rows per step; nothing decoded says so."""
    from types import SimpleNamespace

    from tensorpar.inference_plan import serve_comparison_line
    from tensorpar.serve.metrics import ServeMetrics

    pred = {"layout": "tp=2", "batch": 4, "decode_ms": 5.0, "ttft_ms": 9.0}
    m = ServeMetrics()
    assert serve_comparison_line(pred, m.registry) == ("tensorpar: plan vs measured (tp=2): decode step at 4 rows "
                                                       "5.00 ms predicted; not measured (no request decoded a second "
                                                       "token)")
    req = SimpleNamespace(out=[], prompt=[1, 2], arrived=0.0, last_t=0.0)
    m.token(req, 0.5)                     # a first token: time to first token, not a gap
    req.out = [7]
    for t in (0.004, 0.006, 0.011):       # three gaps: 4, 6 and 11 ms, mean 7 ms
        req.last_t = 1.0
        m.token(req, 1.0 + t)
    for rows in (1, 2):
        m.queue(rows, 0, rows)
    assert serve_comparison_line(pred, m.registry) == (
        "tensorpar: plan vs measured (tp=2): decode step at 4 rows 5.00 ms predicted, 7.00 measured (-29% off) "
        "(mean time between a request's tokens over 3 gaps, at 1.5 rows per step on average)")


@pytest.mark.slow   # one server of 2 ranks (~60 s on the loaded 2-core machine); the choice is tested fast above
def test_serve_plan_auto_serves_the_chosen_layout_and_prints_predicted_vs_measured(tiny, device_file):  # noqa: F811
    """Launched: serve --plan auto on 2 local ranks runs tp=2 through the one serve path; a greedy request answers,
    and after SIGINT rank 0 prints the prediction next to its metrics' mean time between tokens."""
    from tests.decode.test_serve import post, start_server, stop_server
    p, url = start_server(tiny, "--plan", "auto", "--nproc", "2", "--device-file", device_file, "--max-batch", "4")
    try:
        status, body = post(url, "/v1/completions", {"prompt": "the cat", "max_tokens": 6, "temperature": 0,
                                                     "return_token_ids": True})
        assert status == 200 and len(body["choices"][0]["token_ids"]) >= 1, body
    finally:
        rc, left = stop_server(p)
    out = p.stdout.read()
    assert rc == 0 and not left
    end = next(x for x in out.splitlines() if x.startswith("tensorpar: plan vs measured (tp=2): decode step at 4 rows"))
    assert "ms predicted," in end and "measured (" in end and " gaps, at " in end, end
