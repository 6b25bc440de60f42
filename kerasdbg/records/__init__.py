"""kerasdbg's records: the tags, the typed records and the verdict text.

Plain Python (no TensorFlow, JAX or Keras), shared by every capture, the
rules, the sinks and the reader:

- `tags`: every TensorBoard tag kerasdbg writes or reads, built, parsed and
  matched in one module (`kerasdbg.records.tags`);
- `CaptureRecord`: what the capture hands a callback for one step of one
  request, and `CaptureBlock`, what consecutive steps recorded, as arrays
  (`kerasdbg.records.capture_record`);
- `StepRecord` (`Record`, `values_of`): the scalars of one step that rules
  read (`kerasdbg.records.step_record`);
- `StepBlock`: the scalars of consecutive steps with the same tags, as
  arrays, that rules screen (`kerasdbg.records.step_block`);
- `verdict_markdown`, `verdict_rows`: `StopOnRule`'s verdict text, written and
  read back (`kerasdbg.records.verdicts`).

Examples:
    >>> from kerasdbg.records import StepRecord, tags, values_of
    >>> record = StepRecord({tags.statistic(tags.WEIGHTS, "m/d/kernel", "max"): 2.0,
    ...                      tags.LOSS: 0.5})
    >>> list(values_of(record, tags.WEIGHTS, "max")), record[tags.LOSS]
    ([('m/d/kernel', 2.0)], 0.5)
"""

from kerasdbg.records import tags
from kerasdbg.records.capture_record import CaptureBlock
from kerasdbg.records.capture_record import CaptureRecord
from kerasdbg.records.step_block import StepBlock
from kerasdbg.records.step_record import Record
from kerasdbg.records.step_record import StepRecord
from kerasdbg.records.step_record import values_of
from kerasdbg.records.verdicts import VERDICT_TENSORS
from kerasdbg.records.verdicts import verdict_markdown
from kerasdbg.records.verdicts import verdict_rows

__all__ = (
    "CaptureBlock",
    "CaptureRecord",
    "Record",
    "StepBlock",
    "StepRecord",
    "VERDICT_TENSORS",
    "tags",
    "values_of",
    "verdict_markdown",
    "verdict_rows",
)
