import pytest

from training_helpers import build_synthetic_corpus


@pytest.fixture(scope="session")
def synthetic_corpus(tmp_path_factory) -> str:
    """Prefix of a 200-document indexed dataset with a 128-token vocabulary."""
    return build_synthetic_corpus(
        str(tmp_path_factory.mktemp("corpus") / "synthetic_text_document")
    )
