
# Copyright: the idempotency extension authors.
#
# 113_session_bound.pl: session-bound claims (idem_claim(...,
# session_bound => true)) when the owning server session ends.
#
# What it proves:
#   - when the owner's session ends, whichever way (its client killed with
#     kill -9, pg_terminate_backend, kill -9 of its backend and the crash
#     recovery that follows, a clean restart of the server), the next claim
#     takes the key over at once as attempt 2, long before its lease ends,
#     and the dead owner's token is refused (55006) without changing the
#     row;
#   - a claim waiting on the key (wait => '60s') is woken when the owner is
#     terminated and takes it over, within seconds, not at the end of its
#     wait;
#   - while the owner lives the key is in progress for everybody else
#     (retry_after counts the lease), its token works from any session, and
#     its own session finishes it; a session that finished all its keys and
#     disconnects leaves no pending key, no owner_session and no binding
#     lock behind;
#   - 10,000 session-bound claims in one session, by idem_claim_many and by
#     10,000 idem_claim calls in one transaction, work with the default
#     max_locks_per_transaction and hold one binding lock; once the session
#     is gone, another session's idem_claim_many takes all of them over and
#     idem_sweep() resets the others (all of them in one call with a batch
#     larger than what it reads of the index at a time);
#   - with the worker on, it resets the keys of an owner killed with its
#     backend (crash recovery) and of a terminated owner by itself, and
#     leaves a live owner's keys pending.
#
# The binding lock is the advisory lock whose fourth field (pg_locks'
# objsubid) is 7656 (0x1de8); its first two fields hold the binding's
# number, which is the keys' owner_session.
#
# Run as described at the top of t/001_restart.pl.  Port 55473 only names
# the socket file.

use strict;
use warnings FATAL => 'all';

use FindBin;
use lib "$FindBin::Bin/lib";
use IdemTest;
use PostgreSQL::Test::Cluster;
use PostgreSQL::Test::Utils;
use Test::More;
use Time::HiRes qw(time);

# The worker stays off until the last parts: nothing but the claims below
# may reset a key.
my $node = new_node('session_bound', port => 55473,
	conf => [ 'restart_after_crash = on', 'idempotency.sweep_interval = 0' ],
	extension => 1);

sub sql { return $node->safe_psql('postgres', $_[0]); }

my $binding_lock = "locktype = 'advisory' AND objsubid = 7656";

# A new session that will own keys: its psql and its backend's pid.
sub owner
{
	my $s   = $node->background_psql('postgres');
	my $pid = $s->query_safe('SELECT pg_backend_pid()');
	return ($s, $pid);
}

# A session-bound idem_claim($args) in session $s; the row as parse_claim.
sub bound_claim
{
	my ($s, $args) = @_;
	return parse_claim($s->query_safe(
		"SELECT $CLAIM_COLS FROM idempotency.idem_claim($args, session_bound => true)"));
}

# The binding number whose lock backend $pid holds ('' when none).  The
# SQL edition holds no binding lock: its binding is the backend's pid and
# the millisecond it started (pid << 41 | start mod 2^41), read from the
# activity list ('' once the backend is gone).
sub binding_of
{
	my ($pid) = @_;
	return sql("SELECT (classid::bigint << 32) | objid::bigint FROM pg_locks "
		  . "WHERE $binding_lock AND pid = $pid")
	  unless sql_edition();
	return sql("SELECT (pid::bigint << 41) | "
		  . "(floor(extract(epoch FROM backend_start) * 1000)::bigint & 2199023255551) "
		  . "FROM pg_stat_activity WHERE pid = $pid");
}

# Why the SQL edition skips the checks of the binding lock and of settings.
my $no_binding_lock =
  'SQL edition: a binding is the session\'s pid and backend start, held by no lock';
my $no_show =
  'SQL edition: the settings are placeholders without the C library (SHOW fails until one is set)';

# "status,attempt,token is null,owner_session" of key $key.
sub key_state
{
	my ($key) = @_;
	return sql("SELECT concat_ws(',', status, attempt, token IS NULL, "
		  . "coalesce(owner_session::text, 'none')) FROM idempotency.keys "
		  . "WHERE scope = '' AND key = '$key'");
}

# The owner of key $key is gone: the next claim takes it over at once, as
# attempt 2 with a larger token, under a lease of an hour that has not
# ended; the dead token is refused and changes nothing.
sub taken_over_at_once
{
	my ($key, $old, $what) = @_;
	is( sql("SELECT lease_until > clock_timestamp() + interval '10 minutes' "
			  . "FROM idempotency.keys WHERE key = '$key'"),
		't', "$what: the dead owner's lease has most of its hour left");
	my $c = claim($node, 'postgres', "'$key', lease => '1 hour'");
	is($c->{outcome}, 'claimed', "$what: the next claim takes $key over at once");
	is($c->{attempt}, 2,         "$what: as attempt 2");
	cmp_ok($c->{token}, '>', $old->{token}, "$what: with a larger token");
	is(key_state($key), 'pending,2,f,none',
		"$what: $key is pending under the new claim, bound to no session");
	my $row = stored_row($node, 'postgres', '', $key);
	is( sqlstate_of($node, 'postgres',
			"SELECT idempotency.idem_finish('$key', $old->{token}, 200)"),
		'55006', "$what: the dead owner's finish raises 55006");
	is(stored_row($node, 'postgres', '', $key), $row,
		"$what: the dead owner's finish changed nothing");
	is( sqlstate_of($node, 'postgres',
			"SELECT idempotency.idem_finish('$key', $c->{token}, 201)"),
		'00000', "$what: the new owner finishes $key");
	is(sql("SELECT status || ',' || attempt FROM idempotency.idem_lookup('$key')"),
		'succeeded,2', "$what: $key succeeded at attempt 2");
	return $c;
}

is(sql('SHOW max_locks_per_transaction'), '64', 'max_locks_per_transaction has its default');
SKIP:
{
	skip $no_show, 1 if sql_edition();
	is(sql('SHOW idempotency.lease'), '30s', 'idempotency.lease has its default');
}

###############################################################################
# kill -9 of the owner's client
###############################################################################
my ($s, $pid) = owner();
my $c = bound_claim($s, "'client-killed', lease => '1 hour'");
is($c->{outcome}, 'claimed', 'client killed: claimed, session-bound');
is($c->{attempt}, 1,         'client killed: attempt 1');
my $binding = binding_of($pid);
like($binding, qr/^\d+$/, 'client killed: the owner holds one binding lock');
is(key_state('client-killed'), "pending,1,f,$binding",
	'client killed: the key stores the binding as owner_session');
is(claim($node, 'postgres', "'client-killed'")->{outcome}, 'in_progress',
	'client killed: in progress while the owner lives');

# The psql process dies with its connection open; the backend, idle and
# reading from it, sees the connection close and exits.
$s->{run}->signal('KILL');
eval { $s->{run}->finish; };
ok(backend_gone($node, $pid), 'client killed: the backend has ended');
taken_over_at_once('client-killed', $c, 'client killed');

###############################################################################
# pg_terminate_backend of the owner
###############################################################################
($s, $pid) = owner();
$c = bound_claim($s, "'terminated', lease => '1 hour'");
is($c->{outcome}, 'claimed', 'terminated: claimed, session-bound');
is(sql("SELECT pg_terminate_backend($pid)"), 't', 'terminated: pg_terminate_backend');
ok(backend_gone($node, $pid), 'terminated: the backend has ended');
eval { $s->quit; };
taken_over_at_once('terminated', $c, 'terminated');

###############################################################################
# A clean restart of the server
###############################################################################
($s, $pid) = owner();
$c = bound_claim($s, "'restarted', lease => '1 hour'");
is($c->{outcome}, 'claimed', 'restart: claimed, session-bound');
$node->restart;
eval { $s->quit; };
taken_over_at_once('restarted', $c, 'restart');

###############################################################################
# A claim waiting on the key is woken when the owner is terminated
###############################################################################
($s, $pid) = owner();
$c = bound_claim($s, "'waited', lease => '1 hour'");
is($c->{outcome}, 'claimed', 'waiter: the owner claimed, session-bound');

my $w     = $node->background_psql('postgres');
my $w_pid = $w->query_safe('SELECT pg_backend_pid()');
$w->query_until(qr/waiting\n/,
	    "\\echo waiting\nSELECT $CLAIM_COLS FROM idempotency.idem_claim('waited', "
	  . "lease => '1 hour', wait => '60s');\n\\echo done\n");
ok( $node->poll_query_until('postgres',
		"SELECT $CLAIM_WAITING FROM pg_stat_activity WHERE pid = $w_pid"),
	'waiter: the claim sleeps in its wait');
my $t0 = time();
is(sql("SELECT pg_terminate_backend($pid)"), 't', 'waiter: the owner is terminated');
my $out = $w->query_until(qr/done\n/, '');
my $elapsed = time() - $t0;
note(sprintf('waiter: back %.3f s after the owner was terminated', $elapsed));
$out =~ s/\n?done\n.*//s;
my $r = parse_claim($out, lenient => 1);
is($r->{outcome}, 'claimed', 'waiter: the waiting claim takes the key over');
is($r->{attempt}, 2,         'waiter: as attempt 2');
cmp_ok($r->{token}, '>', $c->{token}, 'waiter: with a larger token');
cmp_ok($elapsed, '<', 10,
	'waiter: it returned within seconds of the owner\'s end, not after its 60 s wait');
$w->quit;
eval { $s->quit; };
ok(backend_gone($node, $pid), 'waiter: the owner\'s backend has ended');
is(key_state('waited'), 'pending,2,f,none', 'waiter: the key is the waiter\'s claim');

###############################################################################
# A live owner
###############################################################################
($s, $pid) = owner();
my %tok;
foreach my $k (qw(live-1 live-2 live-3))
{
	$c = bound_claim($s, "'$k', request => '{\"k\": \"$k\"}'");
	is($c->{outcome}, 'claimed', "live: $k claimed with the default lease");
	$tok{$k} = $c->{token};
}
$binding = binding_of($pid);
SKIP:
{
	skip $no_binding_lock, 1 if sql_edition();
	is(sql("SELECT count(*) FROM pg_locks WHERE $binding_lock AND pid = $pid"), '1',
		'live: three keys, one binding lock');
}
is( sql("SELECT string_agg(DISTINCT owner_session::text, ',') FROM idempotency.keys "
		  . "WHERE key LIKE 'live-%'"),
	$binding, 'live: the three keys are bound to it');

$c = claim($node, 'postgres', q{'live-1', request => '{"k": "live-1"}'});
is($c->{outcome}, 'in_progress', 'live: another session\'s claim is in progress');
is($c->{token},   undef,         'live: without a token');
cmp_ok($c->{retry_after}, '>', 15,  'live: retry_after counts the 30 s lease');
cmp_ok($c->{retry_after}, '<=', 30, 'live: retry_after is within the lease');
is(key_state('live-1'), "pending,1,f,$binding", 'live: the in-progress claim changed nothing');
is(sql("SELECT count(*) FROM idempotency.idem_sweep()"
		  . " WHERE expired = 0 AND reset = 0"), '1',
	'live: idem_sweep() leaves the live owner\'s keys alone');
is(key_state('live-2'), "pending,1,f,$binding", 'live: live-2 is still bound');

# The token works from another session too, while the owner lives.
is( sql("SELECT idempotency.idem_extend('live-3', $tok{'live-3'}, '1 hour') IS NOT NULL"),
	't', 'live: another session extends live-3 with its token');
is( sql("SELECT idempotency.idem_finish('live-3', $tok{'live-3'}, 202) IS NOT NULL"),
	't', 'live: another session finishes live-3 with its token');
foreach my $k (qw(live-1 live-2))
{
	is($s->query_safe("SELECT idempotency.idem_finish('$k', $tok{$k}, 200) IS NOT NULL"),
		't', "live: the owner's session finishes $k");
}
is( sql("SELECT string_agg(concat_ws(',', key, status, attempt, "
		  . "coalesce(owner_session::text, 'none')), ' ' ORDER BY key) "
		  . "FROM idempotency.keys WHERE key LIKE 'live-%'"),
	'live-1,succeeded,1,none live-2,succeeded,1,none live-3,succeeded,1,none',
	'live: finished keys are bound to no session');
my $live_rows = key_rows($node, 'postgres', "'live-1', 'live-2', 'live-3'");
is(binding_of($pid), $binding, 'live: the session keeps its binding lock until it ends');

# A clean disconnect after finishing everything leaves nothing behind.
$s->quit;
ok(backend_gone($node, $pid), 'live: the owner disconnected');
is(key_rows($node, 'postgres', "'live-1', 'live-2', 'live-3'"), $live_rows,
	'live: the disconnect changed no key');
is( sql("SELECT count(*) FROM idempotency.keys WHERE key LIKE 'live-%' "
		  . "AND (status = 'pending' OR owner_session IS NOT NULL)"),
	'0', 'live: no pending key, no owner_session left');
SKIP:
{
	skip $no_binding_lock, 1 if sql_edition();
	is(sql("SELECT count(*) FROM pg_locks WHERE $binding_lock"), '0',
		'live: no binding lock is left');
}
is_deeply(claim($node, 'postgres', q{'live-1', request => '{"k": "live-1"}'}),
	replay_row('succeeded', 200, undef), 'live: live-1 replays');

###############################################################################
# 10,000 session-bound claims in one session, default settings
###############################################################################
my $n = 10_000;
my $many_keys = "ARRAY(SELECT 'm-' || i FROM generate_series(1, $n) AS i)";
($s, $pid) = owner();
is( $s->query_safe(
		    "SELECT count(*) FILTER (WHERE outcome = 'claimed' AND attempt = 1 "
		  . "AND token IS NOT NULL) || ',' || count(*) || ',' || "
		  . "bool_and(ord = substr(key, 3)::int) "
		  . "FROM idempotency.idem_claim_many($many_keys, session_bound => true)"),
	"$n,$n,true", "batch: idem_claim_many claims $n keys, session-bound, in order");
$s->query_safe('BEGIN');
is( $s->query_safe(
		    "SELECT count(*) FILTER (WHERE c.outcome = 'claimed' AND c.attempt = 1) "
		  . "FROM generate_series(1, $n) AS i, "
		  . "LATERAL idempotency.idem_claim('s-' || i, session_bound => true) AS c"),
	$n, "batch: $n idem_claim calls claim $n more keys in one transaction");
SKIP:
{
	skip $no_binding_lock, 1 if sql_edition();
	is(sql("SELECT count(*) FROM pg_locks WHERE $binding_lock AND pid = $pid"), '1',
		'batch: the open transaction holds one binding lock');
}
$s->query_safe('COMMIT');
$binding = binding_of($pid);
SKIP:
{
	skip $no_binding_lock, 1 if sql_edition();
	is( sql("SELECT string_agg(concat_ws(' ', locktype, objsubid, mode), ',') FROM pg_locks "
			  . "WHERE pid = $pid AND locktype = 'advisory'"),
		'advisory 7656 ExclusiveLock',
		'batch: after the commit the session holds the binding lock and no other advisory lock');
}
is( sql("SELECT count(*) FILTER (WHERE owner_session = $binding AND status = 'pending' "
		  . "AND attempt = 1) FROM idempotency.keys WHERE key ~ '^[ms]-'"),
	2 * $n, 'batch: all of them are pending and bound to that one binding');
is(claim($node, 'postgres', "'m-77'")->{outcome}, 'in_progress',
	'batch: in progress for others while the owner lives');

is(sql("SELECT pg_terminate_backend($pid)"), 't', 'batch: the owner is terminated');
ok(backend_gone($node, $pid), 'batch: the owner\'s backend has ended');
eval { $s->quit; };
is( sql("SELECT count(*) FILTER (WHERE outcome = 'claimed' AND attempt = 2) || ',' "
		  . "|| count(*) FROM idempotency.idem_claim_many($many_keys, lease => '1 hour')"),
	"$n,$n", "batch: another session's idem_claim_many takes all $n over as attempt 2");
is( sql("SELECT count(*) FROM idempotency.keys WHERE key LIKE 'm-%' AND status = 'pending' "
		  . "AND attempt = 2 AND token IS NOT NULL AND owner_session IS NULL"),
	$n, 'batch: they are pending under the takeovers, bound to no session');
# As documented: call idem_sweep() again while it returns a full batch
# (idempotency.sweep_batch, 1000, by default).
SKIP:
{
	skip $no_show, 1 if sql_edition();
	is(sql('SHOW idempotency.sweep_batch'), '1000', 'batch: sweep_batch has its default');
}
my ($expired, $reset, $calls, $last) = (0, 0, 0, '');
while ($calls++ < 100)
{
	$last = sql('SELECT expired || \'|\' || reset FROM idempotency.idem_sweep()');
	my ($e, $r) = split /\|/, $last;
	$expired += $e;
	$reset   += $r;
	last if $e < 1000 && $r < 1000;
}
is("$expired,$reset", "0,$n",
	"batch: idem_sweep() resets the other $n keys of the ended session, none twice");
like($last, qr/^0\|\d{1,3}$/, 'batch: until it returned less than a full batch');
is( sql("SELECT count(*) FROM idempotency.keys WHERE key LIKE 's-%' AND status = 'pending' "
		  . "AND attempt = 1 AND token IS NULL AND owner_session IS NULL"),
	$n, 'batch: reset: pending, no token, attempt 1, bound to no session');
is( sql("SELECT count(*) FROM idempotency.keys WHERE key LIKE 'm-%' AND attempt = 2 "
		  . "AND token IS NOT NULL"),
	$n, 'batch: the sweep left the taken-over keys alone');
$c = claim($node, 'postgres', "'s-5000'");
is($c->{outcome} . ',' . $c->{attempt}, 'claimed,2', 'batch: a reset key is claimed as attempt 2');

# One ended session's keys beyond one read of the index (which goes 4096
# rows at a time): a single call with a batch large enough resets them all.
($s, $pid) = owner();
is( $s->query_safe(
		    "SELECT count(*) FROM idempotency.idem_claim_many("
		  . "ARRAY(SELECT 'c-' || i FROM generate_series(1, 9000) AS i), session_bound => true)"),
	'9000', 'chunks: 9000 session-bound keys claimed');
is(sql("SELECT pg_terminate_backend($pid)"), 't', 'chunks: the owner is terminated');
ok(backend_gone($node, $pid), 'chunks: the owner\'s backend has ended');
eval { $s->quit; };
is(sql('SELECT expired || \'|\' || reset FROM idempotency.idem_sweep(batch_size => 100000)'),
	'0|9000', 'chunks: one idem_sweep() resets all 9000, across index reads');

###############################################################################
# kill -9 of the owner's backend: the server restarts every session
###############################################################################
($s, $pid) = owner();
$c = bound_claim($s, "'backend-killed', lease => '1 hour'");
is($c->{outcome}, 'claimed', 'backend killed: claimed, session-bound');
kill_backend($node, $pid, 'backend killed');
eval { $s->quit; };
taken_over_at_once('backend-killed', $c, 'backend killed');

###############################################################################
# With the worker on, it resets such keys by itself
###############################################################################
SKIP:
{
	skip 'SQL edition: no background worker (a dead owner\'s keys are reset by idem_sweep(), above)', 20
	  if sql_edition();
	alter_system($node, 'idempotency.sweep_interval', '100ms');
	ok($node->poll_query_until('postgres',
			"SELECT current_setting('idempotency.sweep_interval') = '100ms'"),
		'worker: sweep_interval is 100ms');

	# An owner killed with its backend.
	($s, $pid) = owner();
	$c = bound_claim($s, "'worker-crash', lease => '1 hour'");
	is($c->{outcome}, 'claimed', 'worker, backend killed: claimed, session-bound');
	kill_backend($node, $pid, 'worker, backend killed');
	eval { $s->quit; };
	ok( $node->poll_query_until('postgres',
			"SELECT token IS NULL FROM idempotency.keys WHERE key = 'worker-crash'"),
		'worker, backend killed: the worker resets the key');
	is(key_state('worker-crash'), 'pending,1,t,none',
		'worker, backend killed: pending, attempt 1, no token, no binding');
	$c = claim($node, 'postgres', "'worker-crash', lease => '1 hour'");
	is($c->{outcome} . ',' . $c->{attempt}, 'claimed,2',
		'worker, backend killed: the next claim is attempt 2');

	# A terminated owner beside a live one: nobody claims their keys.
	my ($ls, $lpid) = owner();
	my $lc = bound_claim($ls, "'worker-live', lease => '1 hour'");
	is($lc->{outcome}, 'claimed', 'worker: the live owner claimed');
	my $live_binding = binding_of($lpid);
	($s, $pid) = owner();
	foreach my $k (qw(worker-dead-1 worker-dead-2))
	{
		$c = bound_claim($s, "'$k', lease => '1 hour'");
		is($c->{outcome}, 'claimed', "worker: the doomed owner claimed $k");
	}
	is(sql("SELECT pg_terminate_backend($pid)"), 't', 'worker: the doomed owner is terminated');
	ok(backend_gone($node, $pid), 'worker: its backend has ended');
	eval { $s->quit; };
	ok( $node->poll_query_until('postgres',
			    "SELECT bool_and(token IS NULL) FROM idempotency.keys "
			  . "WHERE key IN ('worker-dead-1', 'worker-dead-2')"),
		'worker: the worker resets the terminated owner\'s keys');
	is(key_state($_), 'pending,1,t,none', "worker: $_ is reset") foreach qw(worker-dead-1 worker-dead-2);
	# Another round after the reset has passed over the live key too.
	ok(wait_next_sweep($node, 'postgres'), 'worker: the worker swept again');
	is(key_state('worker-live'), "pending,1,f,$live_binding",
		'worker: the live owner\'s key stays pending and bound');
	is( sql("SELECT token FROM idempotency.keys WHERE key = 'worker-live'"),
		$lc->{token}, 'worker: with its token');
	is( $ls->query_safe("SELECT idempotency.idem_finish('worker-live', $lc->{token}, 200) IS NOT NULL"),
		't', 'worker: the live owner finishes its key');
	$ls->quit;

	stop_sweeping($node);
}
$node->stop;
done_testing();
