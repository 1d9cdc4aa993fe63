from tools.cli import app

app()
