"""The lab's own errors, each with a message that says what to change."""


class ConfigError(ValueError):
    """A configuration that cannot run; the message names the flag to change."""


class PoolExhaustedError(RuntimeError):
    """A pool has no room left even after eviction."""


class CopyChecksumError(RuntimeError):
    """A host copy's destination does not hold what its source held: the copy was torn or misplaced."""


class ConsensusError(RuntimeError):
    """Ranks hold different values of a quantity that must be identical on all of them."""


class AllocationError(RuntimeError):
    """A rank cannot allocate slots for a copy its peers agreed to start."""


class StallError(RuntimeError):
    """Requests wait, nothing runs, and the copies in flight are never acknowledged: the run cannot progress."""
