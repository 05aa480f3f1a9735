"""The bench command runs end to end on CPU and reports what it promises."""

import json

import hydra_lm.cli


def test_bench_reports_training_and_inference_for_both_archs(tmp_path, capsys):
    out = tmp_path / "bench.json"
    code = hydra_lm.cli.main(["bench", "--model_size", "debug", "--vocab_size", "512", "--batch_size", "2",
                              "--seq_len", "32", "--steps", "2", "--warmup", "1", "--no-compile", "--inference",
                              "--new_tokens", "3", "--device", "cpu", "--json", str(out)])
    assert code == 0
    text = capsys.readouterr().out
    assert "hydra" in text and "dense" in text and "decode batch 1" in text
    report = json.loads(out.read_text())
    assert [r["arch"] for r in report["rows"]] == ["hydra", "dense"]
    for row in report["rows"]:
        assert row["tokens_per_s"] > 0 and row["executed_tflops"] > 0 and row["mfu"] is None  # no MFU on CPU
        assert row["decode_tokens_per_s_batch32"] > 0 and row["kv_cache_bytes_per_token"]["allocated"] > 0
    assert report["rows"][0]["ce_impl"] == "naive" and report["measured_bf16_peak_tflops"] is None
