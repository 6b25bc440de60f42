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
