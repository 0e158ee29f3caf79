"""What the tests share: launching programs and shared worlds of training processes, and the
builders of their inputs (corpora, tokenizers, Hugging Face models, kernel cases). Imported as
`harness.<module>`: tests/ is on sys.path (pytest puts it there for tests/conftest.py; launched
programs get it on PYTHONPATH from `harness.launching.test_env`)."""
