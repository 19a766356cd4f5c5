
# Copyright: the idempotency extension authors.
#
# 215_wait_wakes.pl: a claim with "wait" returns once the attempt it waits
# for settles.
#
# What it proves, for a waiter's idem_claim(..., wait => '30 s') on a key
# held by another session (the holder):
#   - held by the holder's open transaction, the waiter returns when that
#     transaction ends, for each change a transaction can have in flight:
#     a claim of a new key (rollback: the waiter claims it, attempt 1;
#     commit after a finish in the same transaction: the waiter replays the
#     stored response), a takeover of a key whose lease ended (rollback:
#     the waiter takes it over itself, attempt 2; commit after a finish:
#     replay), a finish of a committed claim (commit: replay) and a release
#     of one (commit: the waiter claims the key afresh, attempt 1);
#   - held by an attempt whose claim committed, the waiter returns after
#     that attempt's finish (replay) or release (claimed, attempt 1), each
#     made in autocommit;
#   - every answer is the right one: outcome, attempt, response, a claimed
#     token larger than the holder's, and the stored row afterwards.
# The test waits until the waiter is really waiting before the holder
# settles, by polling pg_stat_activity: the C edition sleeps on its latch
# (wait event type Extension) in every case; the SQL edition waits on the
# holder's transaction as PostgreSQL does (wait event type Lock, and
# pg_blocking_pids of the waiter names the holder) while that transaction
# is open, and polls a committed claim in pg_sleep (wait event PgSleep).
# How long after the holder's COMMIT, ROLLBACK or autocommit call returned
# the waiter's answer arrived is measured and printed with note, not
# asserted.
#
# Run it like the other TAP tests (see the top of t/001_restart.pl).
# Port 55515 only names the socket file.

use strict;
use warnings FATAL => 'all';

use FindBin;
use lib "$FindBin::Bin/lib";
use IdemTest;
use PostgreSQL::Test::Cluster;
use PostgreSQL::Test::Utils;
use Test::More;
use Time::HiRes qw(time);

my $node = new_node('wait_wakes', port => 55515,
	conf => [ 'idempotency.sweep_interval = 0' ], extension => 1);

sub sql { return $node->safe_psql('postgres', $_[0]); }

my $h     = $node->background_psql('postgres');
my $h_pid = $h->query_safe('SELECT pg_backend_pid()');
my $w     = $node->background_psql('postgres');
my $w_pid = $w->query_safe('SELECT pg_backend_pid()');

# The waiter waits for the holder's open transaction.
my $waits_for_xact =
  sql_edition()
  ? "wait_event_type = 'Lock' AND pg_blocking_pids($w_pid) @> ARRAY[$h_pid]"
  : "wait_event_type = 'Extension'";

# The request every call on key $key carries.
sub request_of { return qq('{"key": "$_[0]"}'); }

# A claim by the holder (in its session, so inside its open transaction if
# it has one), with a lease of $lease.
sub holder_claim
{
	my ($key, $lease) = @_;
	return parse_claim($h->query_safe(
		    "SELECT $CLAIM_COLS FROM idempotency.idem_claim('$key', "
		  . "request => " . request_of($key) . ", lease => '$lease')"));
}

# The waiter starts its claim of $key, with a wait of 30 s; it is then
# polled until pg_stat_activity shows it waiting as $condition says.
sub start_waiter
{
	my ($key, $condition, $what) = @_;
	$w->query_until(qr/waiting\n/,
		    "\\echo waiting\nSELECT $CLAIM_COLS FROM idempotency.idem_claim('$key', "
		  . "request => " . request_of($key) . ", lease => '1 hour', wait => '30 s');\n"
		  . "\\echo done\n");
	ok( $node->poll_query_until('postgres',
			"SELECT $condition FROM pg_stat_activity WHERE pid = $w_pid"),
		"$what: the waiter waits");
	return;
}

# The holder runs $sql (its COMMIT, ROLLBACK or settling call); returns the
# waiter's answer, and notes how long after $sql returned it arrived.
my @wake;

sub settle
{
	my ($sql, $what) = @_;
	$h->query_safe($sql);
	my $t0  = time();
	my $out = $w->query_until(qr/done\n/, '');
	push @wake, sprintf('%s %.1f ms', $what, 1000 * (time() - $t0));
	$out =~ s/\n?done\n.*//s;
	return parse_claim($out, lenient => 1);
}

# "status|attempt|token|response_code" of the stored key $key.
sub stored
{
	my ($key) = @_;
	return sql("SELECT concat_ws('|', status, attempt, coalesce(token::text, 'none'), "
		  . "coalesce(response_code::text, 'none')) FROM idempotency.keys "
		  . "WHERE scope = '' AND key = '$key'");
}

# The waiter claimed $key: attempt $attempt with a token larger than the
# holder's, and that is what is stored.
sub waiter_claimed
{
	my ($r, $key, $attempt, $holder_token, $what) = @_;
	is($r->{outcome} . ',' . ($r->{attempt} // 'none'), "claimed,$attempt",
		"$what: the waiter claims the key, attempt $attempt");
	cmp_ok($r->{token} // 0, '>', $holder_token, "$what: with a token larger than the holder's");
	is(stored($key), "pending|$attempt|" . ($r->{token} // 'none') . '|none',
		"$what: the key is pending under the waiter's claim");
	return;
}

# The waiter replays $key as finished with $code and body $body (jsonb
# SQL), attempt $attempt, and that is what is stored.
sub waiter_replays
{
	my ($r, $key, $attempt, $code, $body, $holder_token, $what) = @_;
	is_deeply($r, replay_row('succeeded', $code, body_md5($node, 'postgres', $body)),
		"$what: the waiter replays the stored response");
	is(stored($key), "succeeded|$attempt|$holder_token|$code",
		"$what: the key is stored as the holder finished it");
	return;
}

# A key pending under a committed claim whose lease has ended: what a
# takeover finds.  Returns the claim's token.
sub lapsed_key
{
	my ($key, $what) = @_;
	my $c = claim($node, 'postgres',
		"'$key', request => " . request_of($key) . ", lease => '10 milliseconds'");
	is($c->{outcome}, 'claimed', "$what: the first attempt is claimed");
	ok(wait_lease_over($node, 'postgres', '', $key), "$what: its lease has ended");
	return $c->{token};
}

###############################################################################
# The holder's transaction is open
###############################################################################

# A claim of a new key in flight, rolled back.
{
	my $what = 'insert, rollback';
	$h->query_safe('BEGIN');
	my $c = holder_claim('insert-rb', '1 hour');
	is("$c->{outcome},$c->{attempt}", 'claimed,1', "$what: the holder claims the new key");
	start_waiter('insert-rb', $waits_for_xact, $what);
	my $r = settle('ROLLBACK', $what);
	waiter_claimed($r, 'insert-rb', 1, $c->{token}, $what);
}

# A claim of a new key and its finish in flight, committed.
{
	my $what = 'insert and finish, commit';
	$h->query_safe('BEGIN');
	my $c = holder_claim('insert-commit', '1 hour');
	is("$c->{outcome},$c->{attempt}", 'claimed,1', "$what: the holder claims the new key");
	$h->query_safe("SELECT idempotency.idem_finish('insert-commit', $c->{token}, 201, "
		  . "'{\"r\": \"insert\"}')");
	start_waiter('insert-commit', $waits_for_xact, $what);
	my $r = settle('COMMIT', $what);
	waiter_replays($r, 'insert-commit', 1, 201, q('{"r": "insert"}'), $c->{token}, $what);
}

# A takeover of a key whose lease ended in flight, rolled back: the key is
# back under the lapsed first attempt, which the waiter takes over.
{
	my $what = 'takeover, rollback';
	lapsed_key('takeover-rb', $what);
	$h->query_safe('BEGIN');
	my $c = holder_claim('takeover-rb', '1 hour');
	is("$c->{outcome},$c->{attempt}", 'claimed,2', "$what: the holder takes the key over");
	start_waiter('takeover-rb', $waits_for_xact, $what);
	my $r = settle('ROLLBACK', $what);
	waiter_claimed($r, 'takeover-rb', 2, $c->{token}, $what);
}

# A takeover and its finish in flight, committed.
{
	my $what = 'takeover and finish, commit';
	lapsed_key('takeover-commit', $what);
	$h->query_safe('BEGIN');
	my $c = holder_claim('takeover-commit', '1 hour');
	is("$c->{outcome},$c->{attempt}", 'claimed,2', "$what: the holder takes the key over");
	$h->query_safe("SELECT idempotency.idem_finish('takeover-commit', $c->{token}, 202, "
		  . "'{\"r\": \"takeover\"}')");
	start_waiter('takeover-commit', $waits_for_xact, $what);
	my $r = settle('COMMIT', $what);
	waiter_replays($r, 'takeover-commit', 2, 202, q('{"r": "takeover"}'), $c->{token}, $what);
}

# A finish of a committed claim in flight, committed.
{
	my $what = 'finish, commit';
	my $c = holder_claim('finish-commit', '1 hour');
	is("$c->{outcome},$c->{attempt}", 'claimed,1', "$what: the holder's claim is committed");
	$h->query_safe('BEGIN');
	$h->query_safe("SELECT idempotency.idem_finish('finish-commit', $c->{token}, 203, "
		  . "'{\"r\": \"finish\"}')");
	start_waiter('finish-commit', $waits_for_xact, $what);
	my $r = settle('COMMIT', $what);
	waiter_replays($r, 'finish-commit', 1, 203, q('{"r": "finish"}'), $c->{token}, $what);
}

# A release of a committed claim in flight, committed: the key is gone,
# and the waiter's claim is a first attempt.
{
	my $what = 'release, commit';
	my $c = holder_claim('release-commit', '1 hour');
	is("$c->{outcome},$c->{attempt}", 'claimed,1', "$what: the holder's claim is committed");
	$h->query_safe('BEGIN');
	$h->query_safe("SELECT idempotency.idem_release('release-commit', $c->{token})");
	start_waiter('release-commit', $waits_for_xact, $what);
	my $r = settle('COMMIT', $what);
	waiter_claimed($r, 'release-commit', 1, $c->{token}, $what);
}

###############################################################################
# The holder's claim is committed; it settles in autocommit
###############################################################################

{
	my $what = 'committed claim, finish';
	my $c = holder_claim('committed-finish', '1 hour');
	is("$c->{outcome},$c->{attempt}", 'claimed,1', "$what: the holder's claim is committed");
	start_waiter('committed-finish', $CLAIM_WAITING, $what);
	my $r = settle("SELECT idempotency.idem_finish('committed-finish', $c->{token}, 204, "
		  . "'{\"r\": \"committed\"}')", $what);
	waiter_replays($r, 'committed-finish', 1, 204, q('{"r": "committed"}'), $c->{token}, $what);
}

{
	my $what = 'committed claim, release';
	my $c = holder_claim('committed-release', '1 hour');
	is("$c->{outcome},$c->{attempt}", 'claimed,1', "$what: the holder's claim is committed");
	start_waiter('committed-release', $CLAIM_WAITING, $what);
	my $r = settle("SELECT idempotency.idem_release('committed-release', $c->{token})", $what);
	waiter_claimed($r, 'committed-release', 1, $c->{token}, $what);
}

note("edition $EDITION: the waiter's answer arrived after the holder's call returned: "
	  . join('; ', @wake));

is(sql("SELECT count(*) FROM pg_stat_activity WHERE pid IN ($h_pid, $w_pid) AND state = 'idle'"),
	'2', 'holder and waiter are idle at the end');
$h->quit;
$w->quit;
$node->stop;
done_testing();
