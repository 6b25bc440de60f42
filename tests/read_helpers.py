"""What the read-interval tests share on every backend (no framework imported)."""

from kerasdbg.rules import Rule


class FiresAt(Rule):
    """Fires at one step, on the host (no test in the graph)."""

    requires = (("step", "loss"),)

    def __init__(self, at: int):
        self.at = at

    def check(self, step, record):
        if step == self.at:
            return self.verdict(step, "planted", {"step/loss": record.get("step/loss", 0.0)})
        return None

    def get_config(self):
        return {"at": self.at}


def expected_reads(executions: int, per_read: int) -> int:
    """After the first execution, then every `per_read` executions (the ring
    is full), then at the end for what is left."""
    later = executions - 1
    return 1 + later // per_read + (1 if later % per_read else 0)


class BatchEndWork:
    """Counts, over a fit, the reads at batch ends (`ReadClock.read` while a
    batch is decided) and the work the callbacks do after one: `StopOnRule`
    popping its rows (`StepRows.pop_blocks(final=False)`), writing its own
    scalars, and the statistics callbacks' consumers. A batch end that reads
    nothing does none of it."""

    def __init__(self, monkeypatch):
        from kerasdbg.callbacks import _statistics
        from kerasdbg.callbacks import stop_on_rule
        from kerasdbg.capture import reads, step_rows

        self.batch_reads = self.pops = self.writes = self.consumed = 0
        read, pop = reads.ReadClock.read, step_rows.StepRows.pop_blocks
        write_rows = stop_on_rule.StopOnRule._write_rows
        consume = _statistics.StatisticsCallback._consume

        def counted_read(clock):
            self.batch_reads += clock._batch is not None
            read(clock)

        def counted_pop(rows, final=True):
            self.pops += not final
            return pop(rows, final)

        def counted_write(callback):
            self.writes += 1
            write_rows(callback)

        def counted_consume(callback, items):
            self.consumed += 1
            consume(callback, items)

        monkeypatch.setattr(reads.ReadClock, "read", counted_read)
        monkeypatch.setattr(step_rows.StepRows, "pop_blocks", counted_pop)
        monkeypatch.setattr(stop_on_rule.StopOnRule, "_write_rows", counted_write)
        monkeypatch.setattr(_statistics.StatisticsCallback, "_consume", counted_consume)

    def check(self, reads: int, epochs: int, statistics: int) -> None:
        """`reads` in all (the clock's), over `epochs` epochs, with
        `statistics` statistics callbacks in the fit."""
        # The epoch ends' and the fit's end reads are final: the rest at batch ends.
        assert 0 < self.batch_reads <= reads
        assert self.pops == self.batch_reads
        # Once a batch-end read; twice at an epoch's end (its read, its logs);
        # three times at the fit's end (its read, the restore, the verdicts' text).
        assert self.writes <= self.batch_reads + 2 * epochs + 3
        assert self.consumed <= statistics * reads
