import sys

sys.path.insert(0, "/app")

from wordcount import top_words  # noqa: E402


def test_sample(tmp_path):
    assert top_words("/app/words.txt", 2) == [("the", 3), ("brown", 1)]


def test_case_and_ties(tmp_path):
    text = tmp_path / "t.txt"
    text.write_text("B a b A c\n")
    assert top_words(str(text), 3) == [("a", 2), ("b", 2), ("c", 1)]


def test_fewer_words_than_k(tmp_path):
    text = tmp_path / "t.txt"
    text.write_text("one\n")
    assert top_words(str(text), 5) == [("one", 1)]
