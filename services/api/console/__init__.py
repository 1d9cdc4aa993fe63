"""``/console``: the browser console (its page, script and styles beside this package)."""
