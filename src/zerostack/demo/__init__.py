"""The demo: ``zerostack train``'s training run (:mod:`.train`), the corpus it trains on
(:mod:`.corpus`: the Book of Genesis as bytes) and what it shows and leaves behind (:mod:`.monitor`:
progress bar, CSV log, loss curve, summary)."""
