
# Copyright: the idempotency extension authors.
#
# 106_worker_failure.pl: a database whose sweep keeps failing.
#  - fail1: a BEFORE DELETE trigger on idempotency.keys raises (an audit
#    trigger whose log is full), so every sweep there fails;
#  - fail2: the table was renamed, so the sweeper finds the extension's
#    table missing;
#  - fail3: the database is read-only (default_transaction_read_only set
#    for it), so the sweeper refuses to write there (25006), as the client
#    functions do, and leaves every key in place.
# Each failure is logged once per database and cause (not once per attempt,
# although the launcher tries again several times): the sweeper logs the
# whole error as a WARNING (SQLSTATE, message, the context it was raised in,
# and the database), and the launcher adds one line.  The launcher backs off
# (it visits the failing database far less often than a healthy one), keeps
# sweeping the healthy database meanwhile, and sweeps the failing ones again
# once the cause is gone (logging that once).  The launcher process never
# changes.
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
	"tests how the background worker logs and backs off from failing sweeps; the SQL edition has no worker");

my $node = new_node('failure', port => 55449,
	conf => [ "idempotency.sweep_interval = '200ms'", 'log_error_verbosity = verbose' ]);

sub sql { my ($db, $sql) = @_; return $node->safe_psql($db, $sql); }

sub stat_of
{
	my ($db, $col) = @_;
	return sql('postgres',
		"SELECT $col FROM pg_stat_database WHERE datname = '$db'");
}

# The launcher's lines about database $db.
sub log_lines
{
	my ($db) = @_;
	return grep { /idempotency sweep of database "$db"/ }
	  split /\n/, slurp_file($node->logfile);
}

# The sweeper's reports of an error in database $db: each WARNING of the
# log, with the DETAIL, HINT, CONTEXT and LOCATION lines that follow it (each
# a line of its own, or a tab-indented continuation), that names the
# sweeper of $db in its context.
sub sweeper_reports
{
	my ($db) = @_;
	my @entries;
	for my $line (split /\n/, slurp_file($node->logfile))
	{
		if (@entries
			&& ($line =~ /^\t/ || $line =~ /\] (DETAIL|HINT|CONTEXT|LOCATION):/))
		{
			$entries[-1] .= "\n$line";
		}
		else
		{
			push @entries, $line;
		}
	}
	return grep { /WARNING:/ && /idempotency sweeper in database "$db"/ } @entries;
}

for my $db (qw(healthy fail1 fail2 fail3))
{
	sql('postgres', "CREATE DATABASE $db");
	sql($db, 'CREATE EXTENSION idempotency');
}
my $pid = launcher_pid($node);

# fail1: an audit trigger that fails on every delete.
fail_sweeps_in($node, 'fail1', 'audit_key_delete', 'audit log is full');
is(expiring_keys($node, 'fail1', 'k', 3), '3', 'fail1: 3 keys past retention soon');

# fail2: the table renamed away (by a superuser), in the transaction that
# makes its keys, so that the worker never sees them before the rename.
is( sql('fail2',
		    "BEGIN;\n"
		  . "SELECT count(*) FROM (SELECT idempotency.idem_finish('k-' || i, c.token, 200) "
		  . "FROM generate_series(1, 3) AS i, "
		  . "LATERAL idempotency.idem_claim('k-' || i, lease => '1 second', "
		  . "retention => '1 second') AS c) AS f;\n"
		  . "ALTER TABLE idempotency.keys RENAME TO keys_old;\n"
		  . "COMMIT;"),
	'3', 'fail2: 3 keys past retention soon');

# fail3: made read-only in the transaction that makes its keys.
is( sql('fail3',
		    "BEGIN;\n"
		  . "SELECT count(*) FROM (SELECT idempotency.idem_finish('k-' || i, c.token, 200) "
		  . "FROM generate_series(1, 3) AS i, "
		  . "LATERAL idempotency.idem_claim('k-' || i, lease => '1 second', "
		  . "retention => '1 second') AS c) AS f;\n"
		  . "ALTER DATABASE fail3 SET default_transaction_read_only = on;\n"
		  . "COMMIT;"),
	'3', 'fail3: 3 keys past retention soon, the database read-only');

# Each failed visit rolls back one transaction in its database (nobody
# else uses fail1 and fail2 while we wait).
my %rb = map { $_ => stat_of($_, 'xact_rollback') } qw(fail1 fail2 fail3);
my $healthy_commits = stat_of('healthy', 'xact_commit');
for my $db (qw(fail1 fail2 fail3))
{
	ok( $node->poll_query_until(
			'postgres',
			"SELECT xact_rollback >= $rb{$db} + 3 FROM pg_stat_database "
			  . "WHERE datname = '$db'"),
		"$db: the worker tried (and failed) at least three times");
}

# Backing off: meanwhile the healthy database was visited far more often.
my $healthy_visits = stat_of('healthy', 'xact_commit') - $healthy_commits;
my $fail1_visits = stat_of('fail1', 'xact_rollback') - $rb{fail1};
cmp_ok($healthy_visits, '>', 3 * $fail1_visits,
	"the failing database is visited less often ($fail1_visits failed visits "
	  . "against $healthy_visits commits in the healthy one)");

# Logged once per database and cause.
my @l1 = log_lines('fail1');
is(scalar(@l1), 1, 'fail1: exactly one log line for its failure');
like($l1[0] // '', qr/idempotency sweep of database "fail1" failed: audit log is full/,
	'fail1: the line gives the cause');
my @l2 = log_lines('fail2');
is(scalar(@l2), 1, 'fail2: exactly one log line for its failure');
like($l2[0] // '',
	qr/idempotency sweep of database "fail2" failed: .*(not installed|does not exist)/,
	'fail2: the line says the table is missing');
my @l3 = log_lines('fail3');
is(scalar(@l3), 1, 'fail3: exactly one log line for its failure');
like($l3[0] // '',
	qr/idempotency sweep of database "fail3" failed: cannot sweep a database whose transactions are read-only/,
	'fail3: the line says the database is read-only');
is(scalar(log_lines('healthy')), 0, 'healthy: nothing logged');

# The sweeper logged each error once, in full.
my @r1 = sweeper_reports('fail1');
is(scalar(@r1), 1, 'fail1: the sweeper logged its error once');
like($r1[0] // '', qr/WARNING:\s+P0001: audit log is full/,
	'fail1: ... with its SQLSTATE and message');
like($r1[0] // '', qr/CONTEXT:.*PL\/pgSQL function (public\.)?audit_key_delete\(\)/s,
	'fail1: ... and the context it was raised in (the trigger)');
my @r2 = sweeper_reports('fail2');
is(scalar(@r2), 1, 'fail2: the sweeper logged its error once');
like($r2[0] // '', qr/WARNING:\s+42704: extension "idempotency" is not installed/,
	'fail2: ... with its SQLSTATE and message');
like($r2[0] // '', qr/HINT:\s+Run CREATE EXTENSION idempotency/,
	'fail2: ... and its hint');
my @r3 = sweeper_reports('fail3');
is(scalar(@r3), 1, 'fail3: the sweeper logged its error once');
like($r3[0] // '', qr/WARNING:\s+25006: cannot sweep a database whose transactions are read-only/,
	'fail3: ... with its SQLSTATE and message');
like($r3[0] // '', qr/HINT:\s+Keys past their retention stay until it is off/,
	'fail3: ... and its hint');
is(scalar(sweeper_reports('healthy')), 0, 'healthy: no sweeper error');
is( sql('fail1', "SELECT count(*) FROM idempotency.keys"),
	'3', 'fail1: the failed sweeps left every key in place');
is( sql('fail3', "SELECT count(*) FROM idempotency.keys"),
	'3', 'fail3: the refused sweeps left every key in place');

# One database cannot stop the others: healthy is swept all along.
is(expiring_keys($node, 'healthy', 'k', 3), '3', 'healthy: 3 keys past retention soon');
ok( $node->poll_query_until(
		'healthy', "SELECT count(*) = 0 FROM idempotency.keys"),
	'healthy: swept while the other two fail');

# --- The causes go away: sweeping resumes ---

sql('fail1', 'DROP TRIGGER audit_key_delete ON idempotency.keys');
sql('fail2', 'ALTER TABLE idempotency.keys_old RENAME TO keys');
sql('postgres', 'ALTER DATABASE fail3 RESET default_transaction_read_only');
for my $db (qw(fail1 fail2 fail3))
{
	ok( $node->poll_query_until(
			$db, "SELECT count(*) = 0 FROM idempotency.keys"),
		"$db: swept once the cause is gone");
	is( sql($db,
			"SELECT expired, last_sweep_at IS NOT NULL FROM idempotency.stats "
			  . "WHERE database = current_database()"),
		'3|t', "$db: the stats count its 3 expired keys");
}
for my $db (qw(fail1 fail2 fail3))
{
	$node->wait_for_log(qr/idempotency sweep of database "$db" works again/);
	my @lines = log_lines($db);
	is(scalar(@lines), 2, "$db: one failure line and one 'works again' line");
}

# After recovery the database is swept at the normal pace again.
is(expiring_keys($node, 'fail1', 'again', 2), '2', 'fail1: 2 more keys past retention soon');
ok( $node->poll_query_until(
		'fail1', "SELECT count(*) = 0 FROM idempotency.keys"),
	'fail1: swept again');

# The same failure again later is logged again (once): the cause had gone.
sql('fail1', <<'EOF');
CREATE TRIGGER audit_key_delete BEFORE DELETE ON idempotency.keys
	FOR EACH ROW EXECUTE FUNCTION public.audit_key_delete();
EOF
my $rb1 = stat_of('fail1', 'xact_rollback');
is(expiring_keys($node, 'fail1', 'third', 2), '2', 'fail1: 2 more keys, the trigger back');
ok( $node->poll_query_until(
		'postgres',
		"SELECT xact_rollback >= $rb1 + 2 FROM pg_stat_database "
		  . "WHERE datname = 'fail1'"),
	'fail1: failing again, twice');
is(scalar(grep { /failed: audit log is full/ } log_lines('fail1')),
	2, 'fail1: the recurring failure is logged once more, not per attempt');
is(scalar(sweeper_reports('fail1')), 2,
	'fail1: ... and the sweeper logged the whole error once more');

is(launcher_pid($node), $pid, 'the same launcher process ran all along');
is( scalar(grep { /background worker "idempotency launcher"/ }
		  split /\n/, slurp_file($node->logfile)),
	0, 'the launcher never exited');

$node->stop;
done_testing();
