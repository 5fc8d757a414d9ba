"""The JAX-version shims of ``moajax.compat`` that this JAX (0.10) reaches only in part: each
is checked on this JAX, and the newer JAX's form it translates is checked with a stand-in of
that form (a GPU machine may carry JAX ≥ 0.11; ``bench/results/jax_internals_audit_2026-12-06.md``)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moajax import compat


def test_scan_counts_reads_both_forms_of_a_scans_operand_counts():
    """(consts, carry) of a scan: JAX < 0.11's num_consts/num_carry parameters, or JAX ≥ 0.11's
    ``ft_in`` tree of (consts, carry, xs)."""
    c = jnp.ones(3)

    def f(x):
        return jax.lax.scan(lambda carry, _: ((carry[0] + c, carry[1] * 2.0), None), (x, x), None, length=4)[0]

    (eqn,) = [e for e in jax.make_jaxpr(f)(jnp.zeros(3)).jaxpr.eqns if e.primitive.name == "scan"]
    assert compat.scan_counts(eqn.params) == (1, 2)

    class FlatTree:  # JAX ≥ 0.11: the operands as a tree of (consts, carry, xs)
        def unpack(self):
            return ("c0",), ("k0", "k1", "k2"), ("x0",)

    assert compat.scan_counts({"ft_in": FlatTree(), "jaxpr": None}) == (1, 3)


def test_without_context_mesh_runs_with_no_mesh_set():
    """A custom partitioning's per-device code runs with no context mesh (JAX ≥ 0.11 keeps the
    caller's, Explicit axes included, where XLA's CPU backend then met a Sharding custom call):
    inside, the abstract mesh is empty even under ``jax.set_mesh``; outside, it is the caller's."""
    from jax.sharding import AxisType

    mesh = jax.make_mesh((2,), ("x",), axis_types=(AxisType.Explicit,))
    seen = []
    bare = compat.without_context_mesh(lambda a: seen.append(jax.sharding.get_abstract_mesh()) or a * 2)
    with jax.set_mesh(mesh):
        assert not jax.sharding.get_abstract_mesh().empty
        out = bare(np.ones(2))
        assert not jax.sharding.get_abstract_mesh().empty
    assert seen[0].empty
    np.testing.assert_array_equal(out, 2 * np.ones(2))


@pytest.mark.parametrize("accessor", [True, False])
def test_a_batched_transpose_offer_is_found_with_or_without_the_jaxpr_accessor(accessor):
    """``compat._offered`` finds the token in the callee's debug info whether the callee is a
    ClosedJaxpr with ``.jaxpr`` (JAX 0.10) or one merged type without it (a JAX to come)."""
    plan = object()
    token = next(compat._OFFERS)
    compat._BATCHED_TRANSPOSES[token] = plan

    def f(x):
        return x * 2.0

    f.__name__ = f"{compat._OFFER}{token}"
    closed = jax.make_jaxpr(f)(1.0)

    class Merged:  # the jaxpr itself: debug_info on it, no ``.jaxpr``
        debug_info = closed.jaxpr.debug_info

    assert compat._offered(closed if accessor else Merged()) is plan


def test_explicit_sharding_is_a_values_typed_split_only_on_explicit_axes():
    """``compat.explicit_sharding``: the split in a value's type where its mesh has Explicit
    axes (what the block's Σ over split heads is told to take), None for a plain array and for
    a split over automatic axes (where XLA's partitioner chooses)."""
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    x = jnp.ones((4, 2))
    assert compat.explicit_sharding(x) is None
    auto = Mesh(np.array(jax.devices()[:2]), ("x",))
    assert compat.explicit_sharding(jax.device_put(x, NamedSharding(auto, P("x")))) is None
    AxisType = getattr(jax.sharding, "AxisType", None)
    if AxisType is None or not hasattr(jax, "set_mesh"):
        return  # (a JAX without sharding in types: nothing more to type)
    mesh = Mesh(np.array(jax.devices()[:2]), ("x",), axis_types=(AxisType.Explicit,))
    seen = []

    def typed(x):
        seen.append(compat.explicit_sharding(x))  # (read while tracing: the type carries it)
        return x

    with jax.set_mesh(mesh):
        jax.jit(typed)(jax.device_put(x, NamedSharding(mesh, P("x"))))
    assert seen[0] is not None and tuple(seen[0].spec)[:1] == ("x",)
