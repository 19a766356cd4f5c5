
# Copyright: the idempotency extension authors.
#
# 104_worker_quiet.pl: the library is preloaded but the extension exists in
# no database.  The launcher keeps visiting every database (their
# transaction counters show the visits) and stays quiet: no ERROR, FATAL,
# WARNING or failure line in the log over many rounds, the same launcher
# process all along, nothing created in the databases.  A CREATE EXTENSION
# that is still uncommitted is left alone too; once committed, the database
# is swept.
#
# Run it like the other TAP tests (see the top of t/001_restart.pl).

use strict;
use warnings FATAL => 'all';

use FindBin;
use lib "$FindBin::Bin/lib";
use IdemTest;
use PostgreSQL::Test::Cluster;
use PostgreSQL::Test::Utils;
use Test::More;

skip_sql_edition(
	"tests the background worker's launcher in databases without the extension; the SQL edition has no worker");

my $node = new_node('quiet', port => 55447,
	conf => ["idempotency.sweep_interval = '100ms'"]);

sub sql { my ($db, $sql) = @_; return $node->safe_psql($db, $sql); }

# Wait for at least $n more visits of the worker to each database (the
# transactions committed in a database that no client uses).
sub wait_visits
{
	my ($n, @dbs) = @_;
	for my $db (@dbs)
	{
		ok(wait_commits($node, $db, $n), "the worker visited $db again and again");
	}
}

# The log lines that are not the test's own statements and not start-up.
sub noise
{
	my ($offset) = @_;
	return log_errors($node, offset => $offset,
		pattern => qr/ERROR|FATAL|PANIC|WARNING|failed|could not|sweeper/);
}

my $pid = launcher_pid($node);
like($pid, qr/^\d+$/, 'the launcher runs');

for my $db (qw(quiet1 quiet2 quiet3))
{
	sql('postgres', "CREATE DATABASE $db");
}
is( sql('postgres',
		"SELECT count(*) FROM pg_extension WHERE extname = 'idempotency'"),
	'0', 'no extension in postgres');

wait_visits(10, qw(quiet1 quiet2 quiet3));
is(noise(0), '', 'over many rounds: no error, warning or failure in the log');
is(launcher_pid($node), $pid, 'the same launcher process runs all along');
for my $db (qw(postgres quiet1 quiet2 quiet3 template1))
{
	is( sql($db,
			"SELECT (SELECT count(*) FROM pg_namespace WHERE nspname = 'idempotency') "
			  . "+ (SELECT count(*) FROM pg_extension WHERE extname = 'idempotency')"),
		'0', "$db: the worker created nothing");
}

# --- A CREATE EXTENSION not committed yet is left alone ---

my $offset = -s $node->logfile;
my $creator = $node->background_psql('quiet2');
$creator->query_safe('BEGIN');
$creator->query_safe('CREATE EXTENSION idempotency');
is( $creator->query_safe(
		"SELECT outcome FROM idempotency.idem_claim('in-xact', "
		  . "lease => '1 second', retention => '1 day')"),
	'claimed', 'quiet2: a claim inside the transaction that creates the extension');
wait_visits(10, qw(quiet1 quiet3));
# (quiet2's own commits are not counted: its one client is in a transaction.)
is(noise($offset), '',
	'while CREATE EXTENSION is uncommitted: nothing in the log');
is(launcher_pid($node), $pid, 'the launcher is the same process');
$creator->query_safe('COMMIT');
$creator->quit;

is( sql('quiet2',
		"SELECT status, attempt FROM idempotency.keys WHERE key = 'in-xact'"),
	'pending|1', 'quiet2: the committed claim is in the table');
ok( $node->poll_query_until(
		'quiet2',
		"SELECT token IS NULL FROM idempotency.keys WHERE key = 'in-xact'"),
	'quiet2: once the extension is committed, the worker resets the stale claim');
is( sql('quiet2',
		"SELECT expired, reset, last_sweep_at IS NOT NULL FROM idempotency.stats "
		  . "WHERE database = current_database()"),
	'0|1|t', 'quiet2: one key reset by the worker');
is(noise($offset), '', 'still nothing in the log');

$node->stop;
done_testing();
