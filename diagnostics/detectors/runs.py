from .._detectors import runs_verdict  # noqa: F401  (temporary, during the move)
