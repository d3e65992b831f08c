"""openYuanrong datasystem backend."""
