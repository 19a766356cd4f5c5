
# Copyright: the idempotency extension authors.
#
# 105_worker_ddl.pl: database-level DDL while the worker runs every 100 ms.
#  - CREATE DATABASE from template1 (which has the extension and keys) 20
#    times in a row: every one succeeds (the worker never sits in a
#    template), each copy is swept like any database, template1 is not.
#  - CREATE DATABASE ... TEMPLATE an ordinary database that the worker is
#    busy sweeping: succeeds (visits are short).
#  - DROP DATABASE of all those, of a database the worker is sweeping at
#    that moment, and of one the launcher has listed for its round but not
#    visited yet: succeeds, and the worker logs no failure for it (a
#    dropped database is not a failure).
#  - DROP EXTENSION in a database the worker is sweeping at that moment:
#    succeeds, no failure is logged for it; the database is then left
#    alone, and a new CREATE EXTENSION there is swept again.
# Afterwards the same launcher process still runs and still sweeps.
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
	"tests database DDL while the background worker sweeps; the SQL edition has no worker");

my $node = new_node('ddl', port => 55448,
	conf => [ "idempotency.sweep_interval = '100ms'", 'idempotency.sweep_batch = 10' ]);

sub sql { my ($db, $sql) = @_; return $node->safe_psql($db, $sql); }

# Run a command; returns its stderr ('' when it succeeded without a word).
sub try_sql
{
	my ($db, $sql) = @_;
	my ($ret, $out, $err) = $node->psql($db, $sql);
	return $ret == 0 ? $err : "failed ($ret): $err";
}

# A backlog that keeps the worker busy in $db for a while: $n keys past
# retention, swept 10 per transaction.
sub backlog
{
	my ($db, $n, $p) = @_;
	return expiring_keys($node, $db, $p // 'bl', $n);
}

# Wait until a sweeper works in $db.
sub wait_sweeper_in
{
	my ($db) = @_;
	return $node->poll_query_until(
		'postgres',
		"SELECT count(*) > 0 FROM pg_stat_activity "
		  . "WHERE backend_type = 'idempotency sweeper' AND datname = '$db'");
}

# Keys in template1: one past retention, one kept.
sql('template1', 'CREATE EXTENSION idempotency');
for my $k ([ 'tpl-exp', '1 second' ], [ 'tpl-keep', '1 day' ])
{
	finish_key($node, 'template1', $k->[0], $k->[1], q{'{"from": "template1"}'});
}
ok(wait_past_retention($node, 'template1', 'tpl-exp'),
	'template1: tpl-exp is past its retention');
sql('postgres', 'CREATE EXTENSION idempotency');

my $pid = launcher_pid($node);
like($pid, qr/^\d+$/, 'the launcher runs');

# --- DROP DATABASE of a database listed for the current round ---

# busy comes before dropme in pg_database, so while a sweeper works through
# busy's backlog (a time slice of about a second), the launcher's list for
# that round already holds dropme.
sql('postgres', 'CREATE DATABASE busy TEMPLATE template0');
sql('busy', 'CREATE EXTENSION idempotency');
sql('postgres', 'CREATE DATABASE dropme');
is(backlog('busy', 20000), '20000', 'busy: a backlog of 20000 keys');
ok( $node->poll_query_until(
		'postgres',
		"SELECT last_sweep_at IS NOT NULL FROM idempotency.stats "
		  . "WHERE database = 'dropme'"),
	'dropme has been visited: later rounds list it');
ok(wait_sweeper_in('busy'), 'busy: a sweeper works there');
is(try_sql('postgres', 'DROP DATABASE dropme'), '',
	'DROP DATABASE dropme, while the round that lists it is at busy');
my $busy_swept = sql('postgres',
	"SELECT coalesce(last_sweep_at::text, '') FROM idempotency.stats "
	  . "WHERE database = 'busy'");
ok( $node->poll_query_until(
		'postgres',
		"SELECT last_sweep_at > '$busy_swept' FROM idempotency.stats "
		  . "WHERE database = 'busy'"),
	'busy: the worker finished that visit');
ok(wait_sweeper_in('busy'), 'busy: and the next round started');
is( join("\n", grep { /idempotency sweep of database "dropme"/ }
		  split /\n/, slurp_file($node->logfile)),
	'', 'no failure is logged for the dropped database');

# --- CREATE DATABASE from template1, 20 times ---

my @made;
for my $i (1 .. 20)
{
	is(try_sql('postgres', "CREATE DATABASE d$i"), '',
		"CREATE DATABASE d$i (from template1) succeeds");
	push @made, "d$i";
}
is( sql('postgres',
		"SELECT count(*) FROM pg_database WHERE datname ~ '^d[0-9]+\$'"),
	'20', 'all 20 databases exist');
for my $db (@made)
{
	ok( $node->poll_query_until(
			$db,
			"SELECT string_agg(key, ',' ORDER BY key) FROM idempotency.keys",
			'tpl-keep'),
		"$db: the copy of tpl-exp is swept, tpl-keep stays");
}
is( sql('template1', "SELECT string_agg(key, ',' ORDER BY key) FROM idempotency.keys"),
	'tpl-exp,tpl-keep', 'template1 itself is never swept');
is( sql('postgres',
		"SELECT count(*), sum(expired) FROM idempotency.stats "
		  . "WHERE database ~ '^d[0-9]+\$'"),
	'20|20', 'the stats show one expired key in each of the 20 copies');

# --- CREATE DATABASE from a database the worker is sweeping ---

is(backlog('busy', 20000, 'bl2'), '20000', 'busy: another backlog of 20000 keys');
ok(wait_sweeper_in('busy'), 'busy: a sweeper works there');
for my $i (1 .. 3)
{
	is(try_sql('postgres', "CREATE DATABASE busycopy$i TEMPLATE busy"), '',
		"CREATE DATABASE busycopy$i TEMPLATE busy, while busy is swept");
	push @made, "busycopy$i";
}
ok( $node->poll_query_until(
		'busycopy1', "SELECT count(*) = 0 FROM idempotency.keys"),
	'busycopy1: its copy of the backlog is swept too');

# --- DROP DATABASE, also of a database the worker is sweeping ---

for my $db (@made)
{
	is(try_sql('postgres', "DROP DATABASE $db"), '', "DROP DATABASE $db succeeds");
}
ok(wait_sweeper_in('busy'), 'busy: a sweeper works there (again)');
is(try_sql('postgres', 'DROP DATABASE busy'), '',
	'DROP DATABASE busy succeeds while it is being swept');
is( sql('postgres',
		"SELECT count(*) FROM pg_database WHERE datname ~ '^(d[0-9]+|busy.*)\$'"),
	'0', 'all of them are gone');

# --- DROP EXTENSION in a database the worker is sweeping ---

sql('postgres', 'CREATE DATABASE busyext TEMPLATE template0');
sql('busyext', 'CREATE EXTENSION idempotency');
is(backlog('busyext', 20000), '20000', 'busyext: a backlog of 20000 keys');
ok(wait_sweeper_in('busyext'), 'busyext: a sweeper works there');
is(try_sql('busyext', 'DROP EXTENSION idempotency'), '',
	'DROP EXTENSION succeeds while the database is being swept');
is( sql('busyext',
		"SELECT count(*) FROM pg_extension WHERE extname = 'idempotency'"),
	'0', 'busyext: the extension is gone');
is(sql('busyext', "SELECT to_regclass('idempotency.keys') IS NULL"),
	't', 'busyext: and its table');

# The worker goes on visiting busyext without the extension, and without
# complaint: an extension dropped under a sweep is no failure.
ok(wait_commits($node, 'busyext', 5), 'busyext: the worker keeps visiting');

# A new CREATE EXTENSION there is swept.
sql('busyext', 'CREATE EXTENSION idempotency');
is(backlog('busyext', 5), '5', 'busyext: 5 keys in the new extension');
ok( $node->poll_query_until(
		'busyext', "SELECT count(*) = 0 FROM idempotency.keys"),
	'busyext: swept again after CREATE EXTENSION');

# --- The launcher lived through all of it, and sweeps ---

is(launcher_pid($node), $pid, 'the same launcher process runs');
is(backlog('postgres', 5), '5', 'postgres: 5 keys past retention soon');
ok( $node->poll_query_until(
		'postgres', "SELECT count(*) = 0 FROM idempotency.keys"),
	'postgres: still swept');

is( join("\n", grep { /idempotency sweep of database "busyext"/ }
		  split /\n/, slurp_file($node->logfile)),
	'', 'no failure is logged for the database whose extension was dropped');
# Nothing above was a failure: no failure line at all.
is( join("\n", grep { /idempotency sweep of database .* failed/ }
		  split /\n/, slurp_file($node->logfile)),
	'', 'no sweep failure is logged for any of this DDL');
my @dead = grep { /background worker "idempotency launcher".*(exited|terminated)/ }
  split /\n/, slurp_file($node->logfile);
is(scalar(@dead), 0, 'the launcher never exited');

$node->stop;
done_testing();
