"""Shared test helpers (tests/ is on pytest's pythonpath)."""

import numpy as np


def rel_err(actual, expected) -> float:
    """max |a − e| / max |e|: the relative error of an array against its reference."""
    a = np.asarray(actual, dtype=np.float64)
    e = np.asarray(expected, dtype=np.float64)
    assert a.shape == e.shape, f"shape {a.shape} != {e.shape}"
    if not e.size:
        return 0.0
    assert np.all(np.isfinite(a)), "non-finite values in the result"
    scale = max(float(np.max(np.abs(e))), 1e-300)
    return float(np.max(np.abs(a - e))) / scale


def scaled_err(actual, expected, floor: float = 1.0) -> float:
    """max |a − e| / max(max |e|, floor): relative to the reference, or to the scale ``floor``
    of the computation where the reference is near 0 — a sum that cancels to 0 leaves the
    rounding of its O(floor) terms, in any summation order but the reference's."""
    a = np.asarray(actual, dtype=np.float64)
    e = np.asarray(expected, dtype=np.float64)
    assert a.shape == e.shape, f"shape {a.shape} != {e.shape}"
    assert np.all(np.isfinite(a)), "non-finite values in the result"
    return float(np.max(np.abs(a - e), initial=0.0)) / max(float(np.max(np.abs(e), initial=0.0)), floor)


def score_mod_grads_f64(q, k, v, c, g, mod, causal) -> tuple:
    """Plain jnp in float64, written apart from moajax: the gradients (q, k, v, c) of
    Σ g × softmax(mod(c)(q·kᵀ/√H, b, h, i, j), causal)·V, query head h reading kv head h // G."""
    import jax
    import jax.numpy as jnp

    q, k, v, c, g = (jnp.asarray(x).astype(jnp.float64) for x in (q, k, v, c, g))

    def loss(q, k, v, c):
        B, T, N, H = q.shape
        S, G = k.shape[1], N // k.shape[2]
        b, h, i, j = np.ix_(np.arange(B), np.arange(N), np.arange(T), np.arange(S))
        s = mod(c)(jnp.einsum("btnh,bsnh->bnts", q, jnp.repeat(k, G, axis=2)) / np.sqrt(H), b, h, i, j)
        p = jax.nn.softmax(jnp.where(i >= j, s, -jnp.inf) if causal else s, axis=-1)
        return jnp.sum(jnp.einsum("bnts,bsne->btne", p, jnp.repeat(v, G, axis=2)) * g)

    return jax.grad(loss, argnums=(0, 1, 2, 3))(q, k, v, c)


def jnp_attention(q, k, v, bias, keep, rows):
    """softmax(Q Kᵀ/√H + bias, kept) V in float64 jnp, GQA by repeating K and V: differentiable
    to any order by JAX itself (``references.mha_variants`` is NumPy; jax.nn computes in
    float32). ``keep``: [B, N, T, S] bool (or broadcastable); ``rows``: [B, T] query rows
    kept, or None."""
    import jax.numpy as jnp

    G = q.shape[2] // k.shape[2]
    k, v = jnp.repeat(k, G, 2), jnp.repeat(v, G, 2)
    s = jnp.einsum("btnh,bsnh->bnts", q, k) / np.sqrt(q.shape[-1]) + bias
    s = jnp.where(keep, s, -1e30)  # finite: a row past its query length (zeroed below) keeps no key
    p = jnp.exp(s - jnp.max(s, -1, keepdims=True))
    out = jnp.einsum("bnts,bsnh->btnh", p / jnp.sum(p, -1, keepdims=True), v)
    return out if rows is None else out * rows[:, :, None, None]


def rng(seed=0):
    return np.random.default_rng(seed)


def inputs_of(expr):
    """The moa inputs an expression reads, by name."""
    from moajax import moa

    found = {x.name: x for x in moa.nodes(expr) if isinstance(x, moa.Input)}
    return [found[k] for k in sorted(found)]


_SCALAR_OPS = {"add": np.add, "sub": np.subtract, "mul": np.multiply, "div": np.divide, "neg": np.negative,
               "maximum": np.maximum, "exp": np.exp, "lt": np.less, "where": np.where}


def scalar_value(e, a, env):
    """A scalar DNF term's value by its definition, float64: reads of the one array ``a`` at
    the variables' values in ``env``, literals, index values, the ops above and Σ / ⌈ over
    each variable's extent (an interpreter independent of moajax's lowerings)."""
    from moajax import dnf as D

    if isinstance(e, D.Read):
        return a[tuple(env[i.as_var()] for i in e.index)]
    if isinstance(e, D.Lit):
        return e.value
    if isinstance(e, D.IndexValue):
        return env[e.ix.as_var()]
    if isinstance(e, D.Call):
        return _SCALAR_OPS[e.op](*(scalar_value(c, a, env) for c in e.children))
    vals = [scalar_value(e.body, a, {**env, e.var: n}) for n in range(e.var.extent)]
    return float(np.sum(vals)) if e.monoid == "add" else max(vals)


def op_by_op():
    """Evaluate JAX op by op (``jax.disable_jit``) inside the property tests of the derivative
    rules. A selection ((A = Y) for ⌈/, in our rules and in jax.grad's alike) compares A with
    its maximum Y; jitted, XLA fuses the producers of A into each consumer and may evaluate
    them twice with different rounding (a sum inside A, vectorised in one fusion and not in the
    other), so the hit and its count disagree — 0/0 in jax.grad's own reduce_max rule, ±inf in
    ours. Op by op every value is computed once: the tests check the rules, not XLA's fusion
    (test_adjoint: the case hypothesis found)."""
    import jax

    return jax.disable_jit()


def sub_jaxprs(value) -> list:
    """The jaxprs inside an equation parameter (a Jaxpr, a ClosedJaxpr, or a tuple of them)."""
    if hasattr(value, "eqns"):
        return [value]
    if hasattr(value, "jaxpr") and hasattr(value.jaxpr, "eqns"):
        return [value.jaxpr]
    if isinstance(value, (tuple, list)):
        return [j for v in value for j in sub_jaxprs(v)]
    return []


def walk_eqns(jaxpr, within: tuple = ()):
    """Every equation of a jaxpr and of the jaxprs inside its equations' parameters, each with
    the names of the primitives it lies inside (outermost first)."""
    for eqn in jaxpr.eqns:
        yield eqn, within
        for j in sub_jaxprs(list(eqn.params.values())):
            yield from walk_eqns(j, within + (eqn.primitive.name,))
