"""``tensorpar verify``: run the unsharded model and each sharded layout on the same inputs, module by module.

For every tp degree asked for, ranks are started (:func:`tensorpar.launch.run_ranks`, like ``generate``); each
rank builds the unsharded reference model and the sharded one from the same weights, runs both on the same
token ids with forward hooks, and compares, in execution order:

* the input embedding's output,
* per decoder block: its norms, its attention output, its MLP (or MoE) output, and the block output,
* the final norm, and the logits (gathered over the vocabulary);
* for the families of :mod:`tensorpar.decode.lean`, the lean decode path that ``generate`` and ``serve`` run: the logits
  of a prefill of the first ``s - 1`` tokens and of one decode step of the last one;

with ``--train`` also the loss, every parameter's gradient (each rank's slice against the same slice of the
reference gradient), the global grad norm, and that every tp-replicated parameter (norm weights, replicated
biases) has a bit-identical gradient on every rank. Sequence-parallel activations are gathered along the
sequence before they are compared. Each rank compares what it holds; the reported difference is the maximum
over ranks.

Tolerance rule (:func:`tolerance`). Sharding changes only the order in which floating-point sums are added
(row-parallel all-reduce, the vocabulary-parallel log-sum-exp, matmuls of other shapes), never the math. A
reordered sum of ``K`` terms accumulated in fp32 errs by about ``u32 * sqrt(K)`` relative to its largest term
(random-walk rounding, Higham, "Accuracy and Stability of Numerical Algorithms", 2nd ed., sec. 3.1 / 4.2;
``u32 = 2^-24``); a partial sum rounded to the compute dtype before the all-reduce adds ``u * sqrt(tp)``
(``u``: the dtype's unit roundoff, ``2^-24`` for float32, ``2^-8`` for bfloat16). Each block passed feeds that
error into the next, so the bound grows with the depth ``d`` (blocks passed, +1; twice that for gradients,
which go forward and back). With a safety factor ``C = 8``::

    tol = C * (u32 * sqrt(K) + u * sqrt(tp)) * (d + 1) * max(1, max|reference|)

That bound is for a value reached through ``d`` blocks of upstream differences, and with bf16 it is loose: two
blocks deep it is ~0.4 of ``max(1, max|reference|)``, which a missing all-reduce in a block whose output is
small (~0.05) passes. So every watched module is also checked on its own computation: the unsharded module is run
on the input the sharded one received (gathered along the sequence under sequence parallelism) and the two
outputs are held to the rule at ``d = 0`` relative to that output (``max|output|``, no floor of 1); these rows
carry the kind ``"<kind> (own)"``. A sharding fault inside a module is off by about its own output, ~20x this
bound in bf16 (measured: clean layouts of the test families stay at <= 0.25 of it, tp 2 and 3, fp32 and bf16;
bench/results/verify_own_check.md).

The loss is held to what the logits allow: ``|d loss| <= 2 * max|d logits|`` (the log-sum-exp and the target
logit each move by at most the largest logit difference) plus the fp32 rule above with ``K = V`` and ``d = 0``
for the vocabulary-parallel log-sum-exp. ``K`` is the longest reduction of the model (the largest ``in_features`` of its linear layers). A real
sharding bug (a bias counted ``tp`` times, a missing all-reduce, a wrong slice) is off by the size of the
weights themselves, orders of magnitude above this bound.

``--quantize int8`` (:func:`~tensorpar.verify.policy.q8_tolerance`): the reference is quantized the same way in
plain PyTorch (Q8_0 weights, each Linear's input quantized per block of 32), so both sides compute the same math up
to the order of the sums, but every activation quantizer re-rounds: an element within that order's difference of
a half step takes the other step on one side. The reference is therefore run once unquantized first, and each
value is held to the fp rule plus ``4 * max|Q - F|`` (``Q``, ``F``: the int8 and the unquantized reference's
value): two roundings of the same computation onto the same steps differ by at most the sum of their errors, twice
more for sample maxima. The embedding (a lookup) keeps the fp rule. ``--quantize bf16``: both sides multiply the
same bf16 values in fp32; the fp rule.

One module per concern: :mod:`.policy` (the tolerance rule, :class:`ModuleDiff`, :class:`LayoutReport`),
:mod:`.compare` (the module-by-module comparison), :mod:`.cli` (the command: arguments, checks, ranks, report).
"""
from tensorpar.verify.policy import SAFETY, U_ACC, LayoutReport, ModuleDiff, tolerance, unit_roundoff
from tensorpar.verify.compare import compare_to_reference, reference_grad_norm, watched_modules
from tensorpar.verify.cli import PRESET_VOCAB, add_arguments, build_pair, format_table, main, validate

__all__ = ["SAFETY", "U_ACC", "LayoutReport", "ModuleDiff", "tolerance", "unit_roundoff", "compare_to_reference",
           "reference_grad_norm", "watched_modules", "PRESET_VOCAB", "add_arguments", "build_pair", "format_table",
           "main", "validate"]
