"""What a student runs: one rank's cache by hand (`tour`), the causal chain of a legacy run (`chain`), your own
functions in every rank (`sync_impl`, audited by `sync_audit`), and the exercise's check (`exercise`)."""
