"""The online learner: tap stream in, drafts out (ingest, buffer, daemon, publisher)."""
