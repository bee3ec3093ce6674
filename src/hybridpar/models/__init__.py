"""Single-device model code: no process groups here."""
