from shared.cli import app

app()
