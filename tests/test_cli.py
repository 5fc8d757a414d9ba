"""The command line: moajax derive --list / moajax derive KERNEL."""

import subprocess
import sys

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
