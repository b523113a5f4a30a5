"""The audit's comparison of Kafka's offsets with the database's, offset by offset."""

from kafka2pg.audit import PartitionAudit, _merge


def merged(kafka, database, low=0, compacted=()):
    result = PartitionAudit(0, 100)
    _merge(iter(kafka), iter(database), low, result, compacted_ranges=list(compacted))
    return result


def test_every_offset_once_is_clean():
    result = merged([3, 4, 6], [3, 4, 6])
    assert (result.matched, result.missing, result.duplicated, result.unexplained) == (3, 0, 0, 0)
    assert result.clean


def test_missing_duplicated_and_unexplained_offsets_are_named():
    result = merged([3, 4, 6], [3, 3, 6, 7])
    assert (result.missing, result.duplicated, result.unexplained) == (1, 1, 1)
    assert (result.missing_offsets, result.duplicated_offsets, result.unexplained_offsets) == ([4], [3], [7])
    assert not result.clean


def test_a_row_below_the_low_watermark_is_expired_but_its_second_copy_is_a_duplicate():
    clean = merged([10], [2, 5, 10], low=10)
    assert (clean.expired, clean.duplicated, clean.clean) == (2, 0, True)
    twice = merged([10], [2, 5, 5, 10], low=10)
    assert (twice.expired, twice.duplicated, twice.duplicated_offsets, twice.clean) == (2, 1, [5], False)


def test_on_a_compacted_topic_one_copy_of_a_superseded_record_is_compacted_two_are_not():
    once = merged([10], [4, 10], compacted=[(0, 20)])
    assert (once.compacted, once.clean) == (1, True)
    twice = merged([10], [4, 4, 10], compacted=[(0, 20)])
    assert (twice.compacted, twice.unexplained, twice.clean) == (0, 2, False)
