
# Copyright: the idempotency extension authors.
#
# 103_worker_crash.pl: the worker and crashes.
#  - kill -9 of the launcher: the postmaster treats it as a crash (every
#    backend ends, crash recovery), starts a new launcher, and sweeping
#    resumes; no finished key is lost or changed.
#  - SIGTERM of the launcher (pg_terminate_backend): the postmaster starts
#    it again after its restart time, without a crash.
#  - an immediate shutdown while the worker sweeps a large backlog and a
#    client claims and finishes keys: after restart every finished key that
#    existed before is intact (same checksum), every finish the client saw
#    committed is there with its token and response, and the worker goes on
#    to sweep the rest of the backlog.  A session holds row locks on half of
#    the backlog (the sweeper skips locked rows), so the stop always finds
#    that half unswept, and an advisory lock the client waits for before its
#    last key, so the stop always interrupts the client.
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
	"kills and terminates the background worker's launcher and sweeper; the SQL edition has no worker");
use IPC::Run;
use Time::HiRes qw(usleep);

my $node = new_node('crash', port => 55446,
	conf => [ "idempotency.sweep_interval = '300ms'", 'restart_after_crash = on' ]);

sub sql { my ($db, $sql) = @_; return $node->safe_psql($db, $sql); }

# A digest of every finished key: scope, key, status, token, attempt,
# fingerprint, response, times.  Any change or loss changes it.
my $finished_digest_sql =
	"SELECT count(*) || ':' || coalesce(md5(string_agg(concat_ws('|', scope, key, "
  . "status, token, attempt, encode(fingerprint, 'hex'), response_code, "
  . "response_body::text, created_at, finished_at, expires_at, retention), "
  . "E'\\n' ORDER BY scope, key)), '-') "
  . "FROM idempotency.keys WHERE status <> 'pending'";

sub finished_digest
{
	my ($db) = @_;
	return sql($db, $finished_digest_sql);
}

# $n finished keys named "$prefix-<i>", kept for $retention, in one statement.
sub finish_keys
{
	my ($db, $prefix, $n, $retention, $status) = @_;
	$status //= 'succeeded';
	return sql($db,
		    "SELECT count(*) FROM ("
		  . "SELECT idempotency.idem_finish('$prefix-' || i, c.token, 200 + i % 3, "
		  . "jsonb_build_object('key', '$prefix-' || i, 'pad', repeat('x', i % 50)), "
		  . "status => '$status') "
		  . "FROM generate_series(1, $n) AS i, "
		  . "LATERAL idempotency.idem_claim('$prefix-' || i, "
		  . "request => jsonb_build_object('i', i), lease => '1 second', "
		  . "retention => '$retention') AS c) AS f");
}

# Keys that must survive everything below, in two databases.
sql('postgres', 'CREATE EXTENSION idempotency');
sql('postgres', 'CREATE DATABASE shop');
sql('shop', 'CREATE EXTENSION idempotency');
my %digest;
for my $db (qw(postgres shop))
{
	is(finish_keys($db, 'keep', 300, '1 day'), '300',
		"$db: 300 finished keys kept for a day");
	is(finish_keys($db, 'keep-failed', 50, '1 day', 'failed'), '50',
		"$db: 50 failed keys kept for a day");
	$digest{$db} = finished_digest($db);
	like($digest{$db}, qr/^350:[0-9a-f]{32}$/, "$db: digest of 350 finished keys");
}

# --- kill -9 of the launcher ---

my $pid = launcher_pid($node);
like($pid, qr/^\d+$/, "the launcher runs (pid $pid)");
my $log_offset = -s $node->logfile;
is(kill('KILL', $pid), 1, 'SIGKILL sent to the launcher');

$node->wait_for_log(
	qr/background worker "idempotency launcher" \(PID $pid\) was terminated by signal 9/,
	$log_offset);
# Until the server accepts connections again: poll_query_until feeds its
# query to psql's stdin, which a psql refused during recovery may have
# closed already (IPC::Run dies of the broken pipe).
$node->wait_for_log(
	qr/all server processes terminated; reinitializing.*database system is ready to accept connections/s,
	$log_offset);
ok( $node->poll_query_until(
		'postgres',
		"SELECT count(*) = 1 FROM pg_stat_activity "
		  . "WHERE backend_type = 'idempotency launcher' AND pid <> $pid"),
	'after the crash a new launcher runs');
like(
	slurp_file($node->logfile, $log_offset),
	qr/database system was not properly shut down; automatic recovery in progress/,
	'the server went through crash recovery');

for my $db (qw(postgres shop))
{
	is(finished_digest($db), $digest{$db},
		"$db: every finished key is intact after the launcher's crash");
}

# Sweeping resumes in both databases: an expired key and a stale claim.
for my $db (qw(postgres shop))
{
	is(finish_keys($db, 'after-kill', 5, '1 second'), '5',
		"$db: 5 keys kept for one second");
	is( sql($db,
			"SELECT outcome FROM idempotency.idem_claim('stale-after-kill', "
			  . "lease => '1 second', retention => '1 day')"),
		'claimed', "$db: a claim with a 1 second lease");
}
for my $db (qw(postgres shop))
{
	ok( $node->poll_query_until(
			$db,
			"SELECT count(*) FILTER (WHERE key LIKE 'after-kill-%') = 0 "
			  . "AND bool_and(token IS NULL) FILTER (WHERE key = 'stale-after-kill') "
			  . "FROM idempotency.keys"),
		"$db: the new launcher expires and resets keys");
	is(finished_digest($db), $digest{$db},
		"$db: ... and leaves the kept keys alone");
	is( sql($db,
			"SELECT expired, reset, last_sweep_at IS NOT NULL "
			  . "FROM idempotency.stats WHERE database = current_database()"),
		'5|1|t',
		"$db: stats since the crash: 5 expired, 1 reset");
}

# --- SIGTERM of the launcher: restarted without a crash ---

$pid = launcher_pid($node);
$log_offset = -s $node->logfile;
my ($terminated, $restarted) = restart_launcher($node, $pid);
ok($terminated, 'pg_terminate_backend of the launcher');
ok($restarted, 'the postmaster starts the launcher again');
unlike(
	slurp_file($node->logfile, $log_offset),
	qr/reinitializing|terminated by signal/,
	'a terminated launcher is no crash');
is(finish_keys('shop', 'after-term', 3, '1 second'), '3',
	'shop: 3 keys kept for one second');
ok( $node->poll_query_until(
		'shop',
		"SELECT count(*) = 0 FROM idempotency.keys WHERE key LIKE 'after-term-%'"),
	'shop: the restarted launcher sweeps');

# --- Immediate shutdown during a sweep and claims ---

# A backlog of several thousand expired keys and stale claims, swept in
# batches of one key (a transaction each), so that the worker is in the
# middle of it when we stop.
alter_system($node, 'idempotency.sweep_batch', 1);
# Stop sweeping while the backlog is built, so that it is all there.
stop_sweeping($node);
is(finish_keys('shop', 'backlog', 8000, '1 second'), '8000',
	'shop: 8000 keys kept for one second');
is( sql('shop',
		"SELECT count(*) FROM generate_series(1, 1000) AS i, "
		  . "LATERAL idempotency.idem_claim('st-' || i, lease => '1 second', "
		  . "retention => '1 day') AS c WHERE c.outcome = 'claimed'"),
	'1000', 'shop: 1000 claims with a 1 second lease');
ok( $node->poll_query_until(
		'shop',
		"SELECT max(expires_at) < clock_timestamp() FROM idempotency.keys "
		  . "WHERE key LIKE 'backlog-%'"),
	'shop: the backlog is past its retention');
my $backlog_digest = finished_digest('shop');
$digest{shop} = sql('shop',
	$finished_digest_sql . " AND key NOT LIKE 'backlog-%'");

# A session that lives until the stop holds, in one open transaction, an
# advisory lock the client below waits for before its last key, and a row
# lock on the backlog keys 4001 to 8000.  The sweeper skips a locked row,
# and it takes its candidates in sweep_at order (the order in which the
# backlog was claimed), so it can sweep keys 1 to 4000 and then finds
# nothing it may touch: at least 4000 backlog keys are left at the stop,
# however fast the worker is.  The stop ends the session, and with it the
# locks.
my $locker = $node->background_psql('shop');
$locker->query_safe('BEGIN');
$locker->query_safe('SELECT pg_advisory_xact_lock(103)');
is( $locker->query_safe(
		"SELECT count(*) FROM (SELECT 1 FROM idempotency.keys WHERE scope = '' "
		  . "AND key = ANY (SELECT 'backlog-' || i FROM generate_series(4001, 8000) AS i) "
		  . "FOR UPDATE) AS l"),
	'4000', 'shop: a session holds a row lock on backlog keys 4001 to 8000');

# A client claims and finishes keys, one autocommit statement each, and
# prints a line for each finish it saw committed.  Before its last key it
# waits for the locking session's advisory lock, which is never released
# before the stop.
my $load_sql = '';
for my $i (1 .. 20000)
{
	$load_sql .= "SELECT 'waits', pg_advisory_lock(103);\n" if $i == 20000;
	$load_sql .=
	    "SELECT 'done', c.token, idempotency.idem_finish('load-$i', c.token, 200, "
	  . "'{\"load\": $i}') IS NOT NULL FROM idempotency.idem_claim('load-$i', "
	  . "request => '{\"i\": $i}', retention => '1 day') AS c;\n";
}
my $load_file = PostgreSQL::Test::Utils::tempdir() . '/load.sql';
append_to_file($load_file, $load_sql);
my ($load_out, $load_err) = ('', '');
my $load = IPC::Run::start(
	[ $node->installed_command('psql'), '-XAt', '-d', $node->connstr('shop'), '-f', $load_file ],
	'<', \undef, '>', \$load_out, '2>', \$load_err);

# Let the client get going.
my $spins = 0;
while (($load_out =~ tr/\n//) < 200 && $spins++ < 10 * $PostgreSQL::Test::Utils::timeout_default)
{
	$load->pump_nb;
	usleep(100_000);
}
cmp_ok(($load_out =~ tr/\n//), '>=', 200, 'the client has finished 200 keys');

# Sweeping on again: wait until the worker is part-way through the backlog.
alter_system($node, 'idempotency.sweep_interval', '300ms');
ok( $node->poll_query_until(
		'shop',
		"SELECT count(*) < 8000 FROM idempotency.keys WHERE key LIKE 'backlog-%'"),
	'shop: the worker has started on the backlog');
my $left = sql('shop',
	"SELECT count(*) FROM idempotency.keys WHERE key LIKE 'backlog-%'");
$node->stop('immediate');
# psql ends with an error; collect everything it printed.
$load->finish;
# The locking session died with the server.
eval { $locker->quit; };
my @done = $load_out =~ /^done\|(\d+)\|t$/mg;
cmp_ok($left, '<', 8000, "the backlog was being swept ($left keys left)");
cmp_ok($left, '>=', 4000, 'the sweeper left the locked half of the backlog alone');
cmp_ok(scalar(@done), '>=', 200,
	scalar(@done) . ' load keys were finished before the stop');
cmp_ok(scalar(@done), '<', 20000, 'the stop interrupted the client');
like($load_err,
	qr/connection to server was lost|server closed the connection|terminating connection|no connection to the server/,
	'the client lost its connection');

$node->start;
is(sql('shop', $finished_digest_sql . " AND key NOT LIKE 'backlog-%' AND key NOT LIKE 'load-%'"),
	$digest{shop},
	'shop: every finished key from before the stop is intact');
is(finished_digest('postgres'), $digest{postgres},
	'postgres: every finished key is intact');

# Every finish the client saw committed is stored, with its token and
# response.  (The lines are in order: key load-N is line N.)
my $expect = '';
for my $i (0 .. $#done)
{
	my $n = $i + 1;
	$expect .= "load-$n|succeeded|$done[$i]|1|200|{\"load\": $n}\n";
}
my $n_done = scalar(@done);
is( sql('shop',
		    "SELECT string_agg(concat_ws('|', key, status, token, attempt, "
		  . "response_code, response_body::text), E'\\n' ORDER BY "
		  . "substr(key, 6)::int) || E'\\n' FROM idempotency.keys "
		  . "WHERE key LIKE 'load-%' AND substr(key, 6)::int <= $n_done"),
	$expect, "all $n_done finishes the client saw are stored");
# A load key after them may be committed (reply lost) or absent, never half.
is( sql('shop',
		"SELECT count(*) FROM idempotency.keys WHERE key LIKE 'load-%' "
		  . "AND substr(key, 6)::int > $n_done + 1"),
	'0', 'no load key beyond the one in flight');

# The worker picks up where it stopped: the whole backlog is swept, and the
# stale claims are reset.
ok( $node->poll_query_until(
		'shop',
		"SELECT count(*) FILTER (WHERE key LIKE 'backlog-%') = 0 "
		  . "AND count(*) FILTER (WHERE key LIKE 'st-%' AND token IS NOT NULL) = 0 "
		  . "AND count(*) FILTER (WHERE key LIKE 'st-%') = 1000 "
		  . "FROM idempotency.keys"),
	'shop: after restart the backlog is swept and the stale claims reset');
is(sql('shop', $finished_digest_sql . " AND key NOT LIKE 'backlog-%' AND key NOT LIKE 'load-%'"),
	$digest{shop},
	'shop: the kept keys are still intact after the sweep');
like($backlog_digest, qr/^8\d{3}:/, 'the backlog had been counted');

$node->stop;
done_testing();
