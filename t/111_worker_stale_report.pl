
# Copyright: the idempotency extension authors.
#
# 111_worker_stale_report.pl: a sweeper that outlives its launcher cannot
# report into a later visit.
#
# The launcher and the sweeper it starts share one report slot in shared
# memory.  If the launcher is terminated while a sweeper is still running
# (here: held at a pause point), the postmaster starts a new launcher, whose
# visits use the same slot.  The old sweeper's report, arriving late, must
# be dropped: each visit has a number, passed to its sweeper, and a sweeper
# writes the slot only while it still belongs to its visit.  Otherwise the
# new launcher would read the old report as its own visit's, and blame the
# wrong database for the wrong error.
#
# The steps, each waiting for a condition the test controls:
#  - database a fails to sweep (a trigger raises); its sweeper stops at the
#    pause point "sweeper-report-failure", just before it reports, while
#    this test holds pg_advisory_lock(7655) in a;
#  - the launcher is terminated; the trigger is dropped and a's pause is
#    turned off; the new launcher sweeps a (fine now), then visits b, whose
#    sweeper stops at "sweep-chunk-sorted" (lock 7655 held in b);
#  - a's old sweeper is let go: it reports its failure, which must not land
#    in b's visit; then b's sweeper is terminated before it reports;
#  - the launcher must log that b's sweeper exited without reporting, and
#    must not log a's old error against b.
# Needs a test build (make IDEM_TEST_PAUSES=1), as ./run test makes.
#
# Run as described at the top of t/001_restart.pl.  Port 55452 only names
# the socket file.

use strict;
use warnings FATAL => 'all';

use FindBin;
use lib "$FindBin::Bin/lib";
use IdemTest;
use PostgreSQL::Test::Cluster;
use PostgreSQL::Test::Utils;
use Test::More;

skip_sql_edition(
	"tests the background worker's launcher and sweeper reports at the C library's pause points; the SQL edition has no worker");

my $node = new_node('stale', port => 55452,
	conf => ["idempotency.sweep_interval = '200ms'"]);

sub sql { my ($db, $sql) = @_; return $node->safe_psql($db, $sql); }

for my $db (qw(a b))
{
	sql('postgres', "CREATE DATABASE $db");
	sql($db, 'CREATE EXTENSION idempotency');
}
fail_sweeps_in($node, 'a', 'refuse_delete', 'a refuses to sweep');

# An SQL expression: the pids of the sweepers of database $db that wait
# for advisory lock 7655 ('' when none does).
sub paused_sweeper_sql
{
	my ($db) = @_;
	return "SELECT coalesce(string_agg(a.pid::text, ','), '') "
	  . "FROM pg_stat_activity a JOIN pg_locks l ON l.pid = a.pid "
	  . "WHERE a.backend_type = 'idempotency sweeper' AND a.datname = '$db' "
	  . "AND l.locktype = 'advisory' AND l.objid = 7655 AND NOT l.granted";
}

# Wait until a sweeper of database $db waits for lock 7655; its pid.
sub paused_sweeper
{
	my ($db, $name) = @_;
	ok($node->poll_query_until('postgres', "SELECT '' <> (" . paused_sweeper_sql($db) . ")"),
		$name);
	return sql('postgres', paused_sweeper_sql($db));
}

# Database a: hold the pause lock, then make a key the sweep must delete.
my $hold_a = $node->background_psql('a');
$hold_a->query_safe('SELECT pg_advisory_lock(7655)');
sql('postgres',
	"ALTER DATABASE a SET idempotency.test_pause = 'sweeper-report-failure'");
is(expiring_keys($node, 'a', 'k', 1), '1', 'a: a key past its retention soon');
my $old_sweeper =
  paused_sweeper('a', 'a: its failed sweeper waits just before it reports');

# A new launcher; a is fine again, b's sweeper will stop before it writes.
my $launcher = launcher_pid($node);
sql('postgres', 'ALTER DATABASE a RESET idempotency.test_pause');
sql('a', 'DROP TRIGGER refuse_delete ON idempotency.keys');
my $hold_b = $node->background_psql('b');
$hold_b->query_safe('SELECT pg_advisory_lock(7655)');
sql('postgres',
	"ALTER DATABASE b SET idempotency.test_pause = 'sweep-chunk-sorted'");
is(expiring_keys($node, 'b', 'k', 1), '1', 'b: a key past its retention soon');
my $log_offset = -s $node->logfile;
my ($terminated, $restarted) = restart_launcher($node, $launcher);
ok($terminated, 'the launcher is terminated while a\'s sweeper is held');
ok($restarted, 'the postmaster starts a new launcher');
my $b_sweeper =
  paused_sweeper('b', "b: the new launcher's sweeper waits before it writes");

# a's old sweeper reports now, during b's visit.
$hold_a->query_safe('SELECT pg_advisory_unlock(7655)');
ok( $node->poll_query_until(
		'postgres',
		"SELECT count(*) = 0 FROM pg_stat_activity WHERE pid = $old_sweeper"),
	"a's old sweeper has reported and exited");

# b's sweeper ends without a report of its own.
is(sql('postgres', "SELECT pg_terminate_backend($b_sweeper)"), 't',
	"b's sweeper is terminated before it reports");
$node->wait_for_log(qr/idempotency sweep of database "b" failed/, $log_offset);
my $log = slurp_file($node->logfile, $log_offset);
like($log,
	qr/idempotency sweep of database "b" failed: the sweeper exited without reporting/,
	'the launcher sees that b\'s sweeper did not report');
unlike($log, qr/database "b" failed: a refuses to sweep/,
	'a\'s late report was not taken for b\'s');

$hold_b->query_safe('SELECT pg_advisory_unlock(7655)');
$hold_a->quit;
$hold_b->quit;
$node->stop;
done_testing();

