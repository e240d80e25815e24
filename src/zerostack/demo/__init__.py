"""The demo: ``zerostack train``'s training run (:mod:`.train`) and what it shows and leaves behind
(:mod:`.monitor`: progress bar, CSV log, loss curve, summary)."""
