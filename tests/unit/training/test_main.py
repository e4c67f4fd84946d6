"""Training through pretrain_gpt's main() in this process: loss falls, exact resume, one-line
errors. (pretrain_gpt.py run as a script: tests/e2e/test_pretrain_gpt_script.py.)"""

import json
import time
from pathlib import Path

from megatron_h2.training.main import main
from tests.helpers.tiny_runs import flags, records


def test_tiny_model_learns_and_logs_everything(corpus, tmp_path, capsys):
    assert main(flags(corpus, tmp_path, "--train-iters", "50", "--log-interval", "5",
                      "--eval-interval", "25", "--eval-iters", "2", "--save",
                      str(tmp_path / "ckpt"), "--tensorboard-dir", str(tmp_path / "tb"))) == 0
    rows = [json.loads(x) for x in (tmp_path / "log.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in rows] == list(range(5, 55, 5))
    for key in ("iteration", "lm_loss", "lr", "grad_norm", "tokens_per_sec", "iteration_ms",
                "time"):
        assert all(key in r for r in rows), key
    times = [r["time"] for r in rows]  # when each row was written: aligns runs side by side
    assert times == sorted(times) and abs(times[-1] - time.time()) < 600
    assert rows[0]["lm_loss"] > 4.5 and rows[-1]["lm_loss"] < rows[0]["lm_loss"] - 2.0
    val = records(tmp_path, "val_loss")
    assert set(val) == {25, 50} and val[50] < val[25]
    out = capsys.readouterr().out
    assert "iteration       50/      50 | consumed samples:          400" in out
    assert "model TFLOP/s" in out and "lm loss: " in out
    assert (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").read_text().strip() == "50"
    assert list((tmp_path / "tb").glob("events.out.tfevents.*"))


def test_exact_resume(corpus, tmp_path, capsys):
    """20 iterations straight == 10, then resume for 10 more (dropout on: RNG is restored)."""
    common = ["--log-interval", "1", "--eval-interval", "1000", "--eval-iters", "0",
              "--hidden-dropout", "0.1", "--attention-dropout", "0.1", "--train-iters"]
    straight, resumed = tmp_path / "a", tmp_path / "b"
    assert main(flags(corpus, straight, *common, "20")) == 0
    ckpt = str(resumed / "ckpt")
    assert main(flags(corpus, resumed, *common, "20", "--save", ckpt, "--load", ckpt,
                      "--exit-interval", "10")) == 0
    assert "no checkpoint found" in capsys.readouterr().out
    assert max(records(resumed)) == 10
    assert main(flags(corpus, resumed, *common, "20", "--save", ckpt, "--load", ckpt)) == 0
    assert "resumed from" in capsys.readouterr().out
    assert records(resumed) == records(straight)
    assert len(records(straight)) == 20


def _run_error(argv: list[str], capsys) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err, err
    return err


def test_bad_data_inputs(corpus, tmp_path, capsys):
    assert "missing_text_document.bin not found" in _run_error(
        flags(str(tmp_path / "missing_text_document"), tmp_path), capsys)
    broken = tmp_path / "broken_text_document"
    broken.with_suffix(".bin").write_bytes(Path(corpus + ".bin").read_bytes()[:-100])
    broken.with_suffix(".idx").write_bytes(Path(corpus + ".idx").read_bytes())
    assert "error" in _run_error(flags(str(broken), tmp_path), capsys)
    bad_header = tmp_path / "hdr_text_document"
    bad_header.with_suffix(".bin").write_bytes(Path(corpus + ".bin").read_bytes())
    bad_header.with_suffix(".idx").write_bytes(b"NOTMMIDX" + Path(corpus + ".idx").read_bytes()[8:])
    _run_error(flags(str(bad_header), tmp_path), capsys)
    argv = flags(corpus, tmp_path)
    argv[argv.index("NullTokenizer")] = "WordPieceTokenizer"
    assert "WordPieceTokenizer" in _run_error(argv, capsys)


def test_bad_checkpoint_to_load(corpus, tmp_path, capsys):
    ckpt = tmp_path / "ckpt"
    assert main(flags(corpus, tmp_path, "--train-iters", "2", "--lr-warmup-iters", "1",
                      "--save", str(ckpt))) == 0
    (ckpt / "iter_0000002" / "metadata.json").unlink()
    assert "incomplete" in _run_error(flags(corpus, tmp_path, "--load", str(ckpt)), capsys)
    assert "does not exist" in _run_error(
        flags(corpus, tmp_path, "--load", str(tmp_path / "nowhere")), capsys)


def test_mismatched_model_shape_on_load(corpus, tmp_path, capsys):
    ckpt = tmp_path / "ckpt"
    assert main(flags(corpus, tmp_path, "--train-iters", "2", "--lr-warmup-iters", "1",
                      "--save", str(ckpt))) == 0
    argv = flags(corpus, tmp_path, "--load", str(ckpt), "--train-iters", "4",
                 "--lr-warmup-iters", "1")
    argv[argv.index("--hidden-size") + 1] = "128"
    assert "hidden_size=64" in _run_error(argv, capsys)
