"""``moajax validate`` at tiny sizes: every kernel verified, timed and predicted; the table's
columns; the files it writes; named errors for an unknown kernel or machine."""

import math

import pytest

from moajax import validate
from moajax.cli import main

TINY = {"attention": (32,), "decode": (64,), "tokens": (16,)}


def test_every_kernel_is_verified_in_float64_and_predicted_in_a_table():
    # one run (a module fixture ran once per pytest-xdist worker that took one of its tests)
    rows = validate.run(sizes=TINY, reps=1)
    assert [r.kernel for r in rows] == list(validate.KERNELS)
    for r in rows:
        # float64 kernels against float64 references: a few ulps of the output's scale; decode
        # runs in float32 (the seed's setting), so float32 rounding
        assert r.error <= (1e-5 if r.dtype == "float32" else 1e-12), (r.kernel, r.error)
        assert r.measured_s > 0 and r.predicted_s > 0 and math.isfinite(r.ratio)
        assert r.model_flops > 0 and r.model_bytes > 0 and r.temp_bytes >= 0
        # a row more than 2× off says why; one within says nothing
        assert bool(r.why) == (not 0.5 <= r.ratio <= 2), (r.kernel, r.ratio, r.why)
    lines = validate.table(rows)
    header = [c.strip() for c in lines[0].strip("|").split("|")]
    assert header == list(validate.COLUMNS)
    assert "measured / predicted" in header and "XLA GFLOP" in header and "baseline temp MiB" in header
    assert len(lines) == 2 + len(rows)
    assert all(line.count("|") == len(validate.COLUMNS) + 1 for line in lines[2:])


def test_the_cli_writes_the_report_and_plots(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(validate, "QUICK", TINY)
    # (a named CPU profile: with none measured here, validate would first measure this machine)
    assert main(["validate", "--out", str(tmp_path), "--kernels", "rmsnorm", "decode", "--reps", "1",
                 "--machine", "anvil-epyc-7543"]) == 0
    text = (tmp_path / "validation.md").read_text()
    assert "Machine:" in text and "JAX" in text and "date" in text and "Profile: anvil-epyc-7543" in text
    assert "| rmsnorm | 16 | float64 |" in text and "| decode | 64 | float32 |" in text
    for png in ("validation_time.png", "validation_memory.png"):
        data = (tmp_path / png).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 1000


def test_unknown_kernel_or_machine_is_a_clear_error(tmp_path, capsys):
    with pytest.raises(ValueError, match="unknown kernel.*'flash'.*known: attention"):
        validate.run(["flash"], sizes=TINY)
    assert main(["validate", "--out", str(tmp_path), "--kernels", "flash"]) == 2
    assert "unknown kernel(s) ['flash']" in capsys.readouterr().err
    assert main(["validate", "--out", str(tmp_path), "--machine", "delta-z100"]) == 2
    assert "no machine profile 'delta-z100'" in capsys.readouterr().err
    with pytest.raises(ValueError, match="GPU profile, and this process has no GPU"):
        validate.run(["rmsnorm"], machine="delta-a100", sizes=TINY)
    assert not (tmp_path / "validation.md").exists()


def test_a_gpu_profile_runs_and_predicts_its_pallas_kernels():
    # on a GPU, validate times the Pallas kernels and predicts them with the GPU's ONFs; here the
    # same kernels run interpreted on the CPU: their wiring and float64 results, not their speed
    rows = validate.run(["rmsnorm", "attention_bwd_owner"], machine="delta-a100", sizes=TINY, reps=1,
                        implementation="pallas_interpret")
    assert [r.kernel for r in rows] == ["rmsnorm", "attention_bwd_owner"]
    for r in rows:
        assert r.error <= 1e-12 and r.predicted_s > 0


def test_a_reference_too_large_to_hold_is_left_out_not_faked(monkeypatch):
    # past REFERENCE_BYTES (the seed's largest attention sizes) the kernel still runs and is
    # timed and predicted; its error is unknown, and the table says so
    monkeypatch.setattr(validate, "REFERENCE_BYTES", 0)
    (row,) = validate.run(["attention"], sizes=TINY, reps=1)
    assert row.error != row.error and row.measured_s > 0  # NaN
    assert "| attention | 32 | float64 | — |" in validate.table([row])[2]
    (row,) = validate.run(["rmsnorm"], sizes=TINY, reps=1)  # no O(n²) reference: still checked
    assert row.error <= 1e-12
