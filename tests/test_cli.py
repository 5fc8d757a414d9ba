"""The command line: moajax derive --list / moajax derive KERNEL."""

import subprocess
import sys

import pytest

from moajax.cli import main


def test_derive_list(capsys):
    assert main(["derive", "--list"]) == 0
    out = capsys.readouterr().out
    for name in ("attention", "decode", "rmsnorm", "swiglu", "block"):
        assert name in out


def test_derive_kernel_prints_dnf_and_derivation(capsys):
    assert main(["derive", "attention"]) == 0
    out = capsys.readouterr().out
    assert "DNF attention" in out and "⟨s h⟩ψkey" in out
    assert "[ψ-inner]" in out and "[ψ-transpose]" in out


def test_derive_adjoint_prints_the_backward(capsys):
    assert main(["derive", "rmsnorm", "--adjoint"]) == 0
    out = capsys.readouterr().out
    assert "DNF rmsnorm_adjoint" in out and "output:  d_x" in out and "output:  d_weight" in out
    assert "⟨n d⟩ψg" not in out and "d_out" in out and "[ψ-omega]" in out


def test_derive_saved_adjoint_prints_the_identities_it_applied(capsys):
    assert main(["derive", "attention", "--saved"]) == 0
    out = capsys.readouterr().out
    assert "DNF attention_adjoint_saved" in out and "saved0" in out and "⟨t e_⟩ψout" in out
    assert "identities applied to the DNF:" in out and "[Δ-from-output]" in out


def test_derive_tangent_prints_the_forward_mode_kernel(capsys):
    assert main(["derive", "rmsnorm", "--tangent"]) == 0
    out = capsys.readouterr().out
    assert "DNF rmsnorm_tangent" in out and "output:  t_out" in out and "t_weight" in out
    assert main(["derive", "rmsnorm", "--tangent", "--adjoint"]) == 2
    assert "exclude each other" in capsys.readouterr().err


def test_derive_unknown_kernel(capsys):
    assert main(["derive", "nope"]) == 2
    assert "unknown kernel 'nope'" in capsys.readouterr().err


def test_module_entry_point():
    r = subprocess.run([sys.executable, "-m", "moajax", "derive", "--list"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "rmsnorm" in r.stdout


@pytest.mark.parametrize("argv,said", [
    (["gpu-report", "--arch", "sm_90"], "no GPU profile has arch sm_90; the profiles' archs are"),
    (["gpu-report", "--dtypes", "bogus"], "argument --dtypes: invalid choice: 'bogus'"),
    (["gpu-report", "--head-dims", "0"], "argument --head-dims: 0 is not a positive integer"),
    (["gpu-report", "--only", "grad (MHA"], "--only is not a regular expression: missing ), unterminated subpattern"),
    (["validate", "--reps", "0"], "argument --reps: 0 is not a positive integer"),
], ids=["arch", "dtype", "head-dim", "only", "reps"])
def test_bad_cli_arguments_are_refused_before_any_run(argv, said, capsys):
    """A typo'd arch matched no profile and reported 0 kernels with rc 0; a bad dtype or head
    dim, or 0 reps, failed with a traceback (or after the whole run): each is refused up front."""
    from moajax import ptx

    if argv[0] == "gpu-report" and ptx.toolchain_missing() and "--arch" in argv:
        pytest.skip(f"gpu-report checks the toolchain first: {ptx.toolchain_missing()}")
    try:
        rc = main(argv)
    except SystemExit as e:  # argparse's refusal
        rc = e.code
    assert rc == 2 and said in capsys.readouterr().err


def test_gpu_report_compiles_offline_without_jax_platforms_set():
    """``moajax gpu-report`` run as a command without JAX_PLATFORMS (the Makefile sets it, a
    shell need not): where the CUDA plugin is installed without a CUDA runtime, as here, its
    backend failed to start and the command refused with "no CUDA Triton compilation
    handler". An offline compile needs no GPU backend: it now gets as far as the arguments."""
    import os

    from moajax import ptx

    if ptx.toolchain_missing():
        pytest.skip(f"no offline toolchain here: {ptx.toolchain_missing()}")
    env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}
    r = subprocess.run([sys.executable, "-m", "moajax", "gpu-report", "--arch", "sm_90"], capture_output=True,
                       text=True, timeout=300, env=env)
    assert r.returncode == 2 and "no GPU profile has arch sm_90" in r.stderr, r.stderr[-2000:]


def test_an_out_path_that_cannot_be_written_is_refused_before_the_run(tmp_path, capsys, monkeypatch):
    """gpu-report's and measure's --out must be a file, validate's a folder: found out after the
    whole run before (a traceback). MOAJAX_MACHINE naming no profile is named up front too."""
    from moajax import measure

    monkeypatch.setattr(measure, "measure", lambda *a, **k: pytest.fail("measured before checking --out"))
    assert main(["measure", "--quick", "--out", str(tmp_path)]) == 2
    assert "is a folder; give a file name" in capsys.readouterr().err
    (tmp_path / "file").write_text("")
    assert main(["validate", "--kernels", "decode", "--out", str(tmp_path / "file")]) == 2
    assert "is a file; it names the folder" in capsys.readouterr().err
    monkeypatch.setenv("MOAJAX_MACHINE", "bogus")
    from moajax import machines

    machines.local.cache_clear()
    try:
        assert main(["validate", "--kernels", "decode", "--out", str(tmp_path / "v")]) == 2
        assert "MOAJAX_MACHINE='bogus' is not a machine profile" in capsys.readouterr().err
    finally:
        monkeypatch.delenv("MOAJAX_MACHINE")
        machines.local.cache_clear()
