import pytest

from tests.resilience.jobs import Job


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """A fault-free run with a slow first step (rank 0 sleeps 6 s > the 5 s hang floor after its
    first step): it must raise no fault, and its losses are what every faulty run must end with."""
    job = Job(tmp_path_factory.mktemp("reference") / "run", fault="sleep:rank=0:step=1:seconds=6")
    job.start()
    try:
        summary = job.finish()
    finally:
        job.cleanup()
    return job, summary


@pytest.fixture
def job_factory(tmp_path):
    jobs = []

    def make(**kwargs) -> Job:
        job = Job(tmp_path / f"job{len(jobs)}" / "run", **kwargs)
        jobs.append(job)
        return job

    yield make
    for job in jobs:
        job.cleanup()
