"""Measurements both engines share: held-out sampling and verifier accuracy (``heldout``),
chat-formatted generation (``generation``)."""
