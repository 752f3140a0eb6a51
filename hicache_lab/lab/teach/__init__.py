"""What a student runs: one rank's cache by hand (`tour`), the causal chain of a legacy run (`chain`), your own
functions in every rank (`sync_impl`), audited call by call (`sync_audit`: one call in `audit_call`, how it is
seen in `audit_patch`, each slot's rules in `audit_slots`, every kind of mistake in `mistakes`), the exercise's
check (`exercise`, in words in `explain`, from the shell in `exercise_cli`), notebook 06's trace reading and
measured design question (`questions`), and the repository without the answers (`edition`)."""
