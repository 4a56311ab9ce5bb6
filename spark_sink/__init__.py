"""mqlog on the Spark side: the ``mqlog`` PySpark data source and the Parquet drain job.

``register(spark)`` makes ``spark.read.format("mqlog")`` and ``spark.readStream.format("mqlog")``
available (:mod:`spark_sink.source`; options in :mod:`spark_sink.options`);
:mod:`spark_sink.drain` is ``mqlog spark-drain``. PySpark is imported only when a Spark
function is called, so the broker never loads it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pyspark.sql import SparkSession


def register(spark: SparkSession) -> None:
    """Register the ``mqlog`` data source with ``spark``."""
    from spark_sink.source import MqlogDataSource

    spark.dataSource.register(MqlogDataSource)


__all__ = ["register"]
