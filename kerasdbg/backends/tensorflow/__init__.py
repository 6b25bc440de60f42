"""TensorFlow's capture: gets per-step data out of the compiled train function.

One engine per model, shared by every kerasdbg callback on it. During a `fit`
it wraps the model's `train_step` (an instance attribute, for the duration
of the `fit`). While that step is traced, every optimizer's `apply` is
routed through the engine (`optimizer_routing.optimizer_routes`), so each
optimizer step of the train step, of any optimizer wherever the model keeps
it, computes the requested statistics in-graph and stores them in ring
buffers with one row per train step of an execution. After each execution
the host reads the buffers once and hands the new rows to the callbacks.

Life cycle, driven by the callbacks:

- `attach(request)` in `on_train_begin`: the first one wraps `train_step`
  (and `compute_loss`) and keeps Keras's train function of this fit; later
  ones only add their request, since nothing is traced before the first
  batch.
- `prepare()` in `on_train_batch_begin`: when the last fit on the model had
  requests that build the same graph (`Request.graph_key`, and the same
  Keras function, strategy, train step, optimizers and variables), runs the
  function that fit traced, its slots and buffers handed to this fit's
  requests (`Request.adopt`): no trace. Else has Keras make a new function
  (traced at its first call), and creates the buffers it can before that
  trace (for the optimizers that are built: creating variables inside the
  first trace makes `tf.function` trace twice).
- in the trace: a *channel* per optimizer and per apply of it in the train
  step (WGAN-GP's discriminator: three), created when first seen unless
  `prepare` predicted it, with a *slot* per request: the variables it
  selects among those the optimizer applies, and its buffers.
- `collect()` in `on_train_batch_end` (and at the end): reads new rows.
- `detach(request)` in `on_train_end`: the last one restores the model and
  puts Keras's train function of this fit back, so a later `fit` without
  the callbacks runs it as it was; the instrumented function hangs on it
  for the next fit (`_Traced`). A `fit` that ends by an exception has no
  `on_train_end`; the engine then restores the model from the `fit`
  wrapper (`kerasdbg.capture.keras_objects.wrap_fit`) as that `fit` unwinds, and keeps
  nothing for the next.

Buffers are `ON_READ` / `ONLY_FIRST_REPLICA` variables: under a
`tf.distribute` strategy each replica writes its own copy without any
communication, and the host reads replica 0 (or all, for values a replica
holds alone). Rows are addressed by a train-step id (`row = (id - 1) %
steps_per_execution`), so consecutive train steps of one execution never
share a row and the host needs no reset between executions.

The engine's modules, in the order of the pipeline (each imports only those
before it, type annotations aside; `requests`, what the callbacks ask
for, is the backend-neutral one in `kerasdbg.capture`):

- `requests`: what the callbacks ask for (`Request`, `Freeze`, the records'
  columns) and the schedule predicates the graph evaluates.
- `channels`: where it goes: `Hook` (an optimizer), `Channel` (an apply of
  it in the train step) and `Slot` (a request's variables, buffers and tags
  in a channel).
- `quantities`: the requested statistics computed in the graph, each once
  per step whatever the number of requests asking for it, and written to
  the slots' buffers (`Quantities`).
- `faults`: the fault test, the freeze of the weights and of the forward
  pass's state after a fault, NaN localisation, and the `faults/...`
  scalars they give (`Faults`).
- `collect`: the host side: reads the new rows and hands them to the
  consumers, numbers the steps, says why a request recorded nothing
  (`Collector`).
- `engine`: the core: `engine_for` and `Engine` (the life cycle above, the
  wrapped train step, the routing of the optimizer applies, the train
  step's own row) and the cleanup when a `fit` ends. It hands `quantities`,
  `faults` and `collect` a read-only `EngineView` of what they read of it.

What TensorFlow and its Keras backend keep private is read in one module per
concern (the parts every backend shares are in
`kerasdbg.capture.keras_objects`): `optimizer_routing` (the optimizer
methods routed during a trace), `distribute` (replica contexts and the
all-reduce), `variable_reads`, `datasets` (the pipeline `kerasdbg.doctor`
reads), `randomness` (the global seeds `kerasdbg.deterministic` puts back)
and `multi_worker_fit` (the fix behind `kerasdbg.compat.fix_multi_worker_fit`).
"""
